"""Drive jobs through the farm's stage scripts alone, as its pools would, and report what
Redis spent on them: CPU and commands per job. bench/sharing.py's ``cost`` scenario runs
it in a subprocess for each tree it compares (the farm of today and the one before fair
share), so each imports its own ``prorl_farm``:

    python bench/stage_scripts.py TREE REDIS_URL MODE [N]

MODE: ``fair`` (fair share on, the pools' slots registered: 8 INIT, 64 RUN, 8 EVAL),
``fifo`` (fair share off) or ``before`` (a tree from before fair share). One tenant submits
N jobs (two instances, N/2 samples each, as bench/sharing.py's ``single``); the driver then
takes each queue's messages in turn as a worker does (pop, claim, then hand on to the next
stage or end the job), so the INIT queue holds at most its slots and the rest wait in the
pens, as on a farm. Prints one JSON line. Nothing here times the farm's Python.
"""

from __future__ import annotations

import json
import os
import sys
import time

SLOTS = {"init": 8, "run": 64, "eval": 8}


def main() -> None:
    tree, url, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 8192
    sys.path.insert(0, tree)
    os.environ.update(PRORL_REDIS_URL=url, PRORL_FAIR_SHARE="0" if mode == "fifo" else "1")
    import redis

    from prorl_farm.celery_app import create_celery_app
    from prorl_farm.config import load_settings
    from prorl_farm.jobs.messages import StageMessages
    from prorl_farm.jobs.store import JobStore
    from prorl_farm.states import JobState
    from prorl_farm.worker.kombu import message_args

    settings = load_settings()
    store = JobStore.from_settings(settings)
    messages = StageMessages(create_celery_app(settings))
    r = redis.Redis.from_url(url, decode_responses=True)
    queues = {"init": "init", "run": "run.n", "eval": "eval.n"}
    if mode != "before":
        from prorl_farm.worker.pool import UNGATED

        for stage, queue in queues.items():
            shared = SLOTS[stage] if mode == "fair" else UNGATED
            store.fair_fill(queue, "bench-pool", shared, 0, 3600, {})

    def cost() -> tuple[float, int]:
        cpu = r.info("cpu")
        calls = sum(v["calls"] for k, v in r.info("commandstats").items()
                    if k.startswith("cmdstat_"))
        return cpu["used_cpu_user"] + cpu["used_cpu_sys"], calls

    # The measuring's own calls (INFO twice) are a handful over thousands of jobs.
    cpu0, calls0 = cost()
    t = time.perf_counter()
    store.create_jobs(f"bench-{time.time_ns()}", "synthetic", [{}, {}], n // 2, {}, None,
                      messages=messages)
    done = 0
    nxt = {"init": ("run", queues["run"]), "run": ("eval", queues["eval"])}
    while done < n:
        moved = 0
        for stage, queue in queues.items():
            raw = r.rpop(queue)
            if raw is None:
                continue
            moved += 1
            job_id, token = message_args(json.loads(raw))[:2]
            status, _ = store.claim(job_id, stage, token, "bench-worker")
            if getattr(status, "value", status) != "ok":
                raise SystemExit(f"claim of {job_id} at {stage}: {status}")
            if stage in nxt:
                to, to_queue = nxt[stage]
                store.advance(job_id, stage, token, to, to_queue, "n", "hstate", "{}",
                              messages)
            else:
                store.finish(job_id, JobState.DONE, token=token)
                done += 1
        if not moved:
            raise SystemExit(f"nothing to take with {done} of {n} jobs done")
    took = time.perf_counter() - t
    cpu1, calls1 = cost()
    print(json.dumps({"mode": mode, "jobs": n, "redis_cpu_us_per_job": (cpu1 - cpu0) / n * 1e6,
                      "redis_commands_per_job": (calls1 - calls0) / n,
                      "driver_jobs_per_s": n / took}))


if __name__ == "__main__":
    main()
