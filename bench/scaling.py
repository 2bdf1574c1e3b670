"""Scaling: throughput of the synthetic workload as simulated nodes (each a set of INIT, RUN
and EVAL pools with its own PRORL_NODE and fixed pool sizes) go 1 -> 2 -> 4 -> 8.

Stage times are sleeps long enough that the pools' slots, not this machine's CPU, bound
each node; efficiency is throughput against k x one node's. Redis's commands and CPU time
per job (INFO commandstats / cpu) are the coordinator's cost, and project how many such
nodes one Redis core serves.

    .venv/bin/python bench/scaling.py [--nodes 1,2,4,8] [--jobs-per-node 48] [--record]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, private_redis, report  # noqa: E402
from bench.pipeline import Processes, farm_env  # noqa: E402
from prorl_farm.config import load_settings  # noqa: E402

POOLS = {"init": 2, "run": 4, "eval": 2}
STAGE = {"init_s": 0.1, "run_s": 0.4, "eval_s": 0.1}
IDLE_SETTLE_S, IDLE_S = 3.0, 10.0
WARM_JOBS_PER_NODE = 16
READS = "(reads)"


def start_nodes(procs: Processes, url: str, k: int, tmp: Path) -> None:
    r = redis.Redis.from_url(url)
    t0 = time.time()
    for i in range(k):
        env = dict(farm_env(url, POOLS, events=False), PRORL_NODE=f"sim{i}",
                   PRORL_SANDBOX_DIR=f"/tmp/prs-scale-{i}")
        for stage in POOLS:
            procs.start([sys.executable, "-m", "prorl_farm.cli", "worker", stage], env,
                        tmp / f"sim{i}-{stage}.log")
    end = time.monotonic() + 120
    while not all((r.zscore("prorl:pools", f"{s}:sim{i}") or 0) > t0
                  for s in POOLS for i in range(k)):
        if time.monotonic() > end:
            raise TimeoutError("pools")
        time.sleep(0.1)


def redis_cost(r) -> tuple[dict[str, int], float]:
    """Redis's calls so far by command (those run inside scripts included; under the name
    ``(reads)``, the client reads it served: its round trips), and its CPU s."""
    calls = {k.removeprefix("cmdstat_"): int(v["calls"])
             for k, v in r.info("commandstats").items()}
    calls[READS] = int(r.info("stats")["total_reads_processed"])
    cpu = r.info("cpu")
    return calls, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in b if b[k] - a.get(k, 0)}


def _batch(client, jobs: int) -> None:
    """Submit ``jobs`` synthetic jobs and wait until all are done."""
    resp = client.post("/v1/jobs", json={"handler": "synthetic", "instances": [STAGE],
                                          "n": jobs})
    assert resp.status_code == 202, resp.get_json()
    batch = resp.get_json()["batch_id"]
    while not client.get(f"/v1/batches/{batch}").get_json()["complete"]:
        time.sleep(0.05)
    summary = client.get(f"/v1/batches/{batch}").get_json()
    assert summary["counts"]["done"] == jobs, summary


def run(url: str, k: int, jobs: int, tmp: Path) -> dict:
    from api import create_app

    procs = Processes()
    try:
        start_nodes(procs, url, k, tmp)
        r = redis.Redis.from_url(url, decode_responses=True)
        client = create_app(load_settings(farm_env(url, POOLS, events=False))).test_client()
        time.sleep(3.0)  # past the pools' start-up
        # A first batch opens every connection the pools' threads use: what is measured is
        # the steady state, not a process's first job.
        _batch(client, k * WARM_JOBS_PER_NODE)
        time.sleep(IDLE_SETTLE_S)
        calls0, cpu0 = redis_cost(r)
        t0 = time.monotonic()
        _batch(client, jobs)
        wall = time.monotonic() - t0
        calls1, cpu1 = redis_cost(r)
        # The idle baseline: what pools alone cost Redis per second (heartbeats, reaper),
        # once the jobs' traces (their last heartbeats, the reaper's last looks) are gone.
        time.sleep(IDLE_SETTLE_S)
        calls2, cpu2 = redis_cost(r)
        time.sleep(IDLE_S)
        calls3, cpu3 = redis_cost(r)
        idle = _delta(calls2, calls3)
        busy = _delta(calls0, calls1)
        idle_reads_s, busy_reads = idle.pop(READS, 0) / IDLE_S, busy.pop(READS, 0)
        idle_calls_s = sum(idle.values()) / IDLE_S
        r.close()
        return {"k": k, "jobs": jobs, "wall": wall, "rate": jobs / wall,
                "calls_per_job": (sum(busy.values()) - idle_calls_s * wall) / jobs,
                "reads_per_job": (busy_reads - idle_reads_s * wall) / jobs,
                "by_command": {c: n / jobs for c, n in busy.items()},
                "idle_by_command": {c: n / IDLE_S / k for c, n in idle.items()},
                # Like the commands, less what the idle pools cost over the same time.
                "cpu_ms_per_job": 1000 * (cpu1 - cpu0 - (cpu3 - cpu2) / IDLE_S * wall) / jobs,
                "cpu_ms_per_job_gross": 1000 * (cpu1 - cpu0) / jobs,
                "idle_calls_s": idle_calls_s, "idle_cpu": (cpu3 - cpu2) / IDLE_S}
    finally:
        procs.stop()
        for i in range(k):
            shutil.rmtree(f"/tmp/prs-scale-{i}", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1,2,4,8")
    ap.add_argument("--jobs-per-node", type=int, default=48)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    counts = [int(x) for x in args.nodes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-scale-"))
    rows = []
    try:
        for k in counts:
            with private_redis() as url:  # a fresh Redis per size: clean counters
                rows.append(run(url, k, args.jobs_per_node * k, tmp))
                print({k: v for k, v in rows[-1].items() if "by_command" not in k},
                      flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = rows[0]["rate"] / rows[0]["k"]
    per_node_bound = POOLS["run"] / STAGE["run_s"]
    worst = max(rows, key=lambda x: x["cpu_ms_per_job"])
    # One Redis core saturates at 1000 / cpu_ms_per_job jobs/s; a node does `base` jobs/s.
    served = 1000 / worst["cpu_ms_per_job"] / base
    last = rows[-1]
    top = sorted(last["by_command"].items(), key=lambda kv: -kv[1])
    idle_top = sorted(last["idle_by_command"].items(), key=lambda kv: -kv[1])
    lines = [
        f"### scaling — {date.today()} — {machine()}", "",
        f"Simulated nodes, each INIT/RUN/EVAL pools of {POOLS} with its own PRORL_NODE; "
        f"`synthetic` stages {STAGE} (sleeps: a node's RUN slots bound it at "
        f"{per_node_bound:g} jobs/s); {args.jobs_per_node} jobs per node per run.", "",
        "| nodes | jobs | wall (s) | jobs/s | efficiency vs linear | Redis commands / job | "
        "Redis CPU ms / job |", "|---|---|---|---|---|---|---|",
        *[f"| {x['k']} | {x['jobs']} | {x['wall']:.1f} | {x['rate']:.1f} | "
          f"{x['rate'] / (x['k'] * base):.2f} | {x['calls_per_job']:.0f} | "
          f"{x['cpu_ms_per_job']:.2f} |" for x in rows], "",
        f"Efficiency at {rows[-1]['k']} nodes: **{rows[-1]['rate'] / (rows[-1]['k'] * base):.2f}"
        f"** of linear. Idle pools cost Redis {rows[-1]['idle_calls_s']:.0f} commands/s at "
        f"{rows[-1]['k']} nodes ({rows[-1]['idle_calls_s'] / rows[-1]['k']:.1f} per node: "
        "heartbeats, reaper, queue polls). At "
        f"{worst['cpu_ms_per_job']:.2f} ms of "
        f"Redis CPU per job, one Redis core serves about {1000 / worst['cpu_ms_per_job']:.0f} "
        f"jobs/s: **~{served:.0f} nodes** of this size (the machine runs every pool as well "
        "as Redis, so this is a lower bound).", "",
        f"Commands per job at {last['k']} nodes, by command (inside scripts included): "
        + ", ".join(f"{c} {n:.1f}" for c, n in top if n >= 0.05) + ".", "",
        f"Idle commands per node and second at {last['k']} nodes: "
        + (", ".join(f"{c} {n:.2f}" for c, n in idle_top if n >= 0.005) or "none") + ".", "",
    ]
    report(lines, args.record)


if __name__ == "__main__":
    main()
