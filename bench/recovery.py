"""Recovery benchmark: from kill -9 of a pool to its jobs re-queued.

  python bench/recovery.py [--record]

For each stage: real pools on a private Redis (default liveness settings: heartbeats every
0.5 s, stale after 30 s, sweeps every 1 s), jobs that sit in that stage (16 running or
prefetched, the rest waiting on the node's queue for RUN and EVAL), kill -9 of the stage's
pool, and the time until every job that was in the stage has been re-queued at INIT by
another pool's reaper. Measured with worker presence (the dead pool's Redis connection is
gone) and, as the baseline in the same run, without (PRORL_PRESENCE=0: heartbeat age only).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import redis
from common import machine, private_redis, report  # noqa: E402
from pipeline import Processes, farm_env, start_farm, wait_for  # noqa: E402

POOLS = {"init": 8, "run": 8, "eval": 8}
JOBS = 24
STAGE_S = 120.0  # longer than any wait here: the jobs stay in the stage until it dies


def one(url: str, tmp: Path, stage: str, presence: bool) -> dict:
    r = redis.Redis.from_url(url, decode_responses=True)
    r.flushall()
    os.environ["PRORL_PRESENCE"] = "1" if presence else "0"
    procs = Processes()
    try:
        start_farm(procs, url, POOLS, tmp, events=False)
        pids = {s: p for s, p in zip(POOLS, procs.procs)}
        from api import create_app
        from prorl_farm.config import load_settings

        client = create_app(load_settings(farm_env(url, POOLS))).test_client()
        instance = {f"{s}_s": (STAGE_S if s == stage else 0.0) for s in POOLS}
        resp = client.post("/v1/jobs", json={"handler": "synthetic", "instances": [instance],
                                             "n": JOBS})
        ids = resp.get_json()["job_ids"]
        busy = min(JOBS, POOLS[stage])

        def in_stage() -> list[str]:
            pipe = r.pipeline()
            for i in ids:
                pipe.hmget(f"prorl:job:{i}", "state", "phase")
            return [i for i, (st, ph) in zip(ids, pipe.execute())
                    if st == stage and (ph == "active" or stage != "init")]

        wait_for(lambda: len([i for i in in_stage()
                              if r.hget(f"prorl:job:{i}", "phase") == "active"]) >= busy,
                 60, f"{busy} jobs active in {stage}")
        time.sleep(1.0)  # a few heartbeats of theirs on record
        # The reaper trusts presence only once Redis has run 10 s (after a restart, live
        # workers need a moment to reconnect): a long-running Redis, as in production.
        while int(r.info("server")["uptime_in_seconds"]) < 11:
            time.sleep(0.2)
        held = in_stage()
        os.killpg(pids[stage].pid, signal.SIGKILL)
        killed = time.monotonic()
        pids[stage].wait()
        procs.procs.remove(pids[stage])
        first = None
        while True:
            pipe = r.pipeline()
            for i in held:
                pipe.hget(f"prorl:job:{i}", "requeues")
            done = sum(int(v or 0) >= 1 for v in pipe.execute())
            if done and first is None:
                first = time.monotonic() - killed
            if done == len(held):
                return {"jobs": len(held), "first_s": first,
                        "all_s": time.monotonic() - killed}
            if time.monotonic() - killed > 120:
                return {"jobs": len(held), "first_s": first, "all_s": float("nan"),
                        "left": len(held) - done}
            time.sleep(0.02)
    finally:
        procs.stop()
        os.environ.pop("PRORL_PRESENCE", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    ap.add_argument("--stages", default="init,run,eval")
    args = ap.parse_args()
    rows = []
    with private_redis() as url, tempfile.TemporaryDirectory() as d:
        for stage in args.stages.split(","):
            fast = one(url, Path(d), stage, presence=True)
            slow = one(url, Path(d), stage, presence=False)
            rows.append((stage, fast, slow))
            print(stage, fast, slow, flush=True)
    lines = [f"\n## Recovery from kill -9 of a pool ({datetime.date.today()}, {machine()})\n",
             f"{JOBS} jobs submitted to sit in the stage (pools {POOLS}: INIT holds 8, "
             "the others' queues the rest); default liveness settings "
             "(heartbeat 0.5 s, stale 30 s, sweep 1 s, presence grace 1.5 s). Time from the "
             "kill to every one of the pool's jobs re-queued at INIT.\n",
             "| pool killed | jobs | presence: first / all re-queued | heartbeat age only "
             "(baseline): first / all | speed-up |", "|---|---|---|---|---|"]
    for stage, fast, slow in rows:
        lines.append(f"| {stage} | {fast['jobs']} | {fast['first_s']:.2f} / "
                     f"{fast['all_s']:.2f} s | {slow['first_s']:.1f} / {slow['all_s']:.1f} s "
                     f"| {slow['all_s'] / fast['all_s']:.1f}x |")
    report(lines, args.record)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
