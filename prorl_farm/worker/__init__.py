"""What runs inside a worker pool process: the pool itself, the stage runner, liveness
(heartbeats, aborts, deadlines), the reaper and the reading of kombu's messages."""

from prorl_farm.worker.pool import execute_stage, get_farm, worker_main

__all__ = ["get_farm", "execute_stage", "worker_main"]
