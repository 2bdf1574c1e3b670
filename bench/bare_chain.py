"""The baseline the farm's overhead is measured against: a bare three-hop Celery chain of
no-op tasks (hop1 -> hop2 -> hop3, one worker process per hop), with the same reliability
settings as the farm (JSON, acks late, prefetch 1), and no job store at all."""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

URL = os.environ.get("PRORL_REDIS_URL", "redis://127.0.0.1:6379/0")
app = Celery("bare_chain", broker=URL)
app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True,
                task_acks_late=True, task_reject_on_worker_lost=True,
                worker_prefetch_multiplier=1, worker_hijack_root_logger=False)
_r = redis.Redis.from_url(URL)

# Mono baseline (no stage pools): one pool runs each job's three stages back to back.
MONO_DONE = "bench:mono:done"
DONE = "bench:bare:done"


@app.task(name="bench.hop1")
def hop1(job_id: str) -> None:
    app.send_task("bench.hop2", args=[job_id], queue="hop2")


@app.task(name="bench.hop2")
def hop2(job_id: str) -> None:
    app.send_task("bench.hop3", args=[job_id], queue="hop3")


@app.task(name="bench.hop3")
def hop3(job_id: str) -> None:
    _r.rpush(DONE, f"{job_id} {time.time():.6f}")


@app.task(name="bench.mono")
def mono(job_id: str, init_s: float, run_s: float, eval_s: float) -> None:
    for seconds in (init_s, run_s, eval_s):
        time.sleep(seconds)
    _r.rpush(MONO_DONE, f"{job_id} {time.time():.6f}")
