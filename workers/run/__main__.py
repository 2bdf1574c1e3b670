"""`python -m workers.run`: start the RUN pool (same as `prorl-farm worker run`)."""

from prorl_farm.worker import worker_main

if __name__ == "__main__":
    worker_main("run")
