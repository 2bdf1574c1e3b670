"""`python -m workers.eval`: start the EVAL pool (same as `prorl-farm worker eval`)."""

from prorl_farm.worker import worker_main

if __name__ == "__main__":
    worker_main("eval")
