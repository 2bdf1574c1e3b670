"""`python -m workers.init`: start the INIT pool (same as `prorl-farm worker init`)."""

from prorl_farm.worker import worker_main

if __name__ == "__main__":
    worker_main("init")
