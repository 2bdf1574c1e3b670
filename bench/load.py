"""Load: 10,000 jobs from 4 parallel submitters through the HTTP API under gunicorn.

Reports the API's read latency (GET of a batch summary and of /v1/overview) on the idle farm
(the baseline) and while the queues are thousands deep, submission latency, the time to
drain, jobs per second, and Redis's peak memory; fails if any job fails (no faults are
injected here; tests/test_faults.py injects them).

    .venv/bin/python bench/load.py [--jobs 10000] [--submitters 4] [--record]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import redis
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, pct, private_redis, report  # noqa: E402
from bench.pipeline import Processes, start_farm_api  # noqa: E402

POOLS = {"init": 16, "run": 64, "eval": 16}
STAGE = {"init_s": 0.0, "run_s": 0.05, "eval_s": 0.0}


def probe(base: str, paths: list[str], stop: threading.Event, out: list[float],
          interval_s: float = 0.05) -> None:
    s = requests.Session()
    while not stop.is_set():
        for path in paths:
            t0 = time.perf_counter()
            s.get(base + path, timeout=30).raise_for_status()
            out.append(time.perf_counter() - t0)
        stop.wait(interval_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--submitters", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=500, help="jobs per submit request")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-load-"))
    procs = Processes()
    try:
        with private_redis() as url:
            base = start_farm_api(procs, url, POOLS, tmp)
            r = redis.Redis.from_url(url, decode_responses=True)
            # Baseline: reads on the idle farm (one small finished batch to read).
            s = requests.Session()
            warm = s.post(base + "/v1/jobs", json={"handler": "synthetic",
                                                   "instances": [STAGE]}).json()["batch_id"]
            time.sleep(1.0)
            idle: list[float] = []
            stop = threading.Event()
            t = threading.Thread(target=probe, args=(base, [f"/v1/batches/{warm}",
                                                            "/v1/overview"], stop, idle))
            t.start()
            time.sleep(3.0)
            stop.set()
            t.join()

            per = args.jobs // args.submitters
            batches: list[str] = []
            submit_s: list[float] = []
            lock = threading.Lock()

            def submitter(k: int) -> None:
                sess = requests.Session()
                left = per
                while left:
                    n = min(args.chunk, left)
                    t0 = time.perf_counter()
                    body = {"handler": "synthetic", "n": n,
                            "instances": [{**STAGE, "payload": str(k)}]}
                    resp = sess.post(base + "/v1/jobs", json=body, timeout=120)
                    if resp.status_code != 202:
                        raise SystemExit(f"submit: {resp.status_code} {resp.text[:500]}")
                    with lock:
                        submit_s.append(time.perf_counter() - t0)
                        batches.append(resp.json()["batch_id"])
                    left -= n

            loaded: list[float] = []
            stop = threading.Event()
            prober = threading.Thread(target=probe, args=(base, [f"/v1/batches/{warm}",
                                                                 "/v1/overview"], stop, loaded))
            t0 = time.monotonic()
            prober.start()
            threads = [threading.Thread(target=submitter, args=(k,))
                       for k in range(args.submitters)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            submitted_s = time.monotonic() - t0
            peak_depth = max(int(r.zcard("prorl:queued:init")), 0)
            while True:
                summaries = [s.get(f"{base}/v1/batches/{b}").json() for b in batches]
                if all(x["complete"] for x in summaries):
                    break
                peak_depth = max(peak_depth, r.zcard("prorl:queued:init"))
                time.sleep(0.5)
            drain_s = time.monotonic() - t0
            stop.set()
            prober.join()
            failed = sum(x["counts"]["failed"] + x["counts"]["cancelled"] for x in summaries)
            done = sum(x["counts"]["done"] for x in summaries)
            peak_mb = int(r.info("memory")["used_memory_peak"]) / 2**20
            r.close()
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if failed or done != per * args.submitters:
        raise SystemExit(f"{failed} jobs failed, {done} done of {per * args.submitters}")
    p50_idle, p99_idle = pct(idle, 50) * 1000, pct(idle, 99) * 1000
    p50_load, p99_load = pct(loaded, 50) * 1000, pct(loaded, 99) * 1000
    lines = [
        f"### load — {date.today()} — {machine()}", "",
        f"{done:,} `synthetic` jobs (run 50 ms) from {args.submitters} parallel submitters "
        f"in requests of {args.chunk}; pools {POOLS}; API under gunicorn (2 workers x 16 "
        "threads); reads probed every 50 ms (a batch summary and /v1/overview).", "",
        "| measure | value |", "|---|---|",
        f"| API read p50 / p99, idle farm (baseline) | {p50_idle:.1f} / {p99_idle:.1f} ms |",
        f"| API read p50 / p99, queues deep | {p50_load:.1f} / {p99_load:.1f} ms |",
        f"| submit request ({args.chunk} jobs) p50 / p99 | {pct(submit_s, 50) * 1000:.0f} / "
        f"{pct(submit_s, 99) * 1000:.0f} ms |",
        f"| all submitted after | {submitted_s:.1f} s |",
        f"| deepest INIT queue seen | {peak_depth:,} |",
        f"| drained (all {done:,} done) after | {drain_s:.1f} s |",
        f"| throughput | {done / drain_s:.0f} jobs/s |",
        f"| Redis peak memory | {peak_mb:.0f} MiB |",
        f"| failed jobs | {failed} |", "",
        f"Reads under load / idle: **{p50_load / p50_idle:.2f}x** (p50), "
        f"**{p99_load / p99_idle:.2f}x** (p99).", "",
    ]
    report(lines, args.record)


if __name__ == "__main__":
    main()
