"""Submission benchmark: a trainer step's rollouts submitted through the API.

  python bench/submit.py [--reps 8] [--record]

A private Redis, the API as `prorl-farm up` runs it (gunicorn, 2 workers, each an event
loop and 16 threads), no pools (nothing consumes the messages: the queue is emptied between
requests). Each request goes through ``FarmClient.submit`` (JSON over HTTP, an idempotency key, the
API's validation, the job store's one transaction with the INIT messages). Sizes: 500
distinct instances (n=1), 128 x n=16 (2,048 jobs) and 512 x n=16 (8,192 jobs), from one
submitter and from four at once. The baseline, measured in the same run, is the floor the
job store cannot beat: as many job hashes, queue entries and Celery messages written with
one Redis pipeline from a client in the same process, nothing else.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import redis
import requests
from common import machine, pct, private_redis, report  # noqa: E402
from pipeline import Processes, farm_env, wait_for  # noqa: E402

from prorl_farm.cli import api_argv  # noqa: E402
from prorl_farm.config import load_settings  # noqa: E402
from prorl_farm.supervisor import free_port  # noqa: E402
from prorl_farm.trainer import FarmClient  # noqa: E402

SIZES = [(500, 1), (128, 16), (512, 16)]  # instances, n


def _up(base: str) -> bool:
    try:
        return requests.get(base + "/healthz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def instances(count: int) -> list[dict]:
    return [{"run_s": 0.0, "reward": float(i % 2), "init_s": 0.0} for i in range(count)]


def floor_s(url: str, jobs: int, reps: int) -> float:
    """Median time to write ``jobs`` job hashes, queue entries and ~1 KB messages with one
    pipeline (MULTI/EXEC), what a submission writes at the least."""
    r = redis.Redis.from_url(url, decode_responses=True)
    body = base64.b64encode(json.dumps([["j" * 32, "t" * 32], {}, {}]).encode()).decode()
    message = json.dumps({"body": body, "headers": {"id": "t" * 32, "x": "y" * 600},
                          "properties": {"delivery_tag": "d" * 36}})
    times = []
    for _ in range(reps):
        pipe = r.pipeline(transaction=True)
        t0 = time.perf_counter()
        for k in range(jobs):
            job_id = os.urandom(16).hex()
            pipe.hset(f"floor:job:{job_id}", mapping={
                "id": job_id, "batch_id": "b", "handler": "synthetic", "instance_id": "i",
                "instance_index": k, "sample_index": 0, "sampling": "{}", "state": "queued",
                "stage": "init", "phase": "waiting", "token": "t" * 32, "queue": "init",
                "requeues": 0, "created_at": "1", "t_init_queued": "1", "deadline_at": "",
                "mode": "policy"})
            pipe.zadd("floor:queued", {job_id: 1.0})
            pipe.lpush("floor:init", message)
        pipe.execute()
        times.append(time.perf_counter() - t0)
        r.flushall()
    return sorted(times)[len(times) // 2]


def measure(base: str, r, size: tuple[int, int], submitters: int, reps: int) -> list[float]:
    """Seconds per request, ``reps`` requests per submitter, submitters running at once."""
    count, n = size
    body = instances(count)
    out: list[float] = []
    lock = threading.Lock()

    def submitter() -> None:
        client = FarmClient(base)
        for _ in range(reps):
            t0 = time.perf_counter()
            sub = client.submit("synthetic", body, n=n)
            dt = time.perf_counter() - t0
            assert len(sub["job_ids"]) == count * n
            with lock:
                out.append(dt)

    FarmClient(base).submit("synthetic", body, n=n)  # warm: connections, scripts
    for _ in range(2):
        threads = [threading.Thread(target=submitter) for _ in range(submitters)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        r.flushall()  # the messages and jobs of these requests, before the next round
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4, help="requests per submitter and round")
    ap.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = ap.parse_args()
    rows = []
    with private_redis() as url, tempfile.TemporaryDirectory() as d:
        procs = Processes()
        port = free_port()
        try:
            procs.start(api_argv(load_settings(farm_env(url, {}, events=False)), "127.0.0.1", port),
                        farm_env(url, {}, events=False), Path(d) / "api.log")
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: _up(base), 30, "api")  # /readyz would want pools too
            r = redis.Redis.from_url(url)
            for size in SIZES:
                jobs = size[0] * size[1]
                floor = floor_s(url, jobs, 5)
                one = measure(base, r, size, 1, args.reps)
                four = measure(base, r, size, 4, args.reps)
                rows.append((size, jobs, floor, one, four))
                print(size, f"floor {floor:.3f}", f"1: {pct(one, 50):.3f}",
                      f"4: {pct(four, 50):.3f}", flush=True)
        finally:
            procs.stop()
    lines = [f"\n## Submission ({datetime.date.today()}, {machine()})\n",
             "`FarmClient.submit` to the API as `prorl-farm api` serves it (2 workers x 16 "
             f"threads), no pools; {2 * args.reps} requests per submitter. Floor: the same "
             "number of job hashes, queue entries and ~1 KB messages written with one Redis "
             "pipeline (MULTI/EXEC) in process, measured in the same run.\n",
             "| jobs (instances x n) | floor (ms) | 1 submitter p50 / p99 (ms) | p50 / floor "
             "| 4 submitters p50 / p99 (ms) | 4 / 1 (p50) |", "|---|---|---|---|---|---|"]
    for (count, n), jobs, floor, one, four in rows:
        lines.append(
            f"| {jobs:,} ({count} x {n}) | {1000 * floor:.0f} | {1000 * pct(one, 50):.0f} / "
            f"{1000 * pct(one, 99):.0f} | {pct(one, 50) / floor:.2f}x | "
            f"{1000 * pct(four, 50):.0f} / {1000 * pct(four, 99):.0f} | "
            f"{pct(four, 50) / pct(one, 50):.2f}x |")
    report(lines, args.record)


if __name__ == "__main__":
    main()
