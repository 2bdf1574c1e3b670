"""Pipeline benchmark: stage pools vs. one pool per job, and the farm's own overhead.

  python bench/pipeline.py [--jobs 320] [--record]

1. Throughput with the synthetic handler (INIT 0.5 s, RUN 2 s, EVAL 0.5 s) as a ratio of
   the bound min over stages(pool size / stage time), against a baseline without stage
   pools: one pool of the INIT pool's size runs each job's three stages back to back.
2. Overhead with all stage times 0: jobs/s and per-job latency of the farm against a bare
   three-hop Celery chain of no-op tasks, measured in the same run.
Everything runs for real: a private redis-server, Celery worker processes, the Flask app.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from common import ROOT, machine, pct, private_redis, report  # noqa: E402

from prorl_farm.cli import api_argv  # noqa: E402
from prorl_farm.config import load_settings  # noqa: E402

STAGE_S = {"init": 0.5, "run": 2.0, "eval": 0.5}
POOLS = {"init": 8, "run": 32, "eval": 8}


class Processes:
    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv, env, log: Path) -> subprocess.Popen:
        with open(log, "ab") as f:
            p = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []


def wait_for(pred, timeout_s, what):
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.02)


def farm_env(url: str, pools: dict, events: bool = True) -> dict:
    env = dict(os.environ, PRORL_REDIS_URL=url, PRORL_NODE="bench", PRORL_LOG_LEVEL="WARNING",
               PYTHONPATH=str(ROOT), PRORL_TASK_EVENTS="1" if events else "0")
    for stage, n in pools.items():
        env[f"PRORL_{stage.upper()}_CONCURRENCY"] = str(n)
    return env


def start_farm(procs, url, pools, tmp, events: bool = True) -> None:
    env = farm_env(url, pools, events)
    r = redis.Redis.from_url(url)
    t0 = time.time()
    for stage in pools:
        procs.start([sys.executable, "-m", "prorl_farm.cli", "worker", stage], env,
                    tmp / f"{stage}.log")
    wait_for(lambda: all((r.zscore("prorl:pools", f"{s}:bench") or 0) > t0 for s in pools),
             60, "pools ready")


def start_farm_api(procs, url, pools, tmp) -> str:
    """The pools (events off) and the API as deployed (2 workers x 16 threads) on a free
    port; returns the API's base URL once /readyz passes."""
    from prorl_farm.supervisor import free_port
    from prorl_farm.trainer import FarmClient

    start_farm(procs, url, pools, tmp, events=False)
    port = free_port()
    env = farm_env(url, pools, events=False)
    procs.start(api_argv(load_settings(env), "127.0.0.1", port), env, tmp / "api.log")
    base = f"http://127.0.0.1:{port}"
    wait_for(FarmClient(base).ready, 30, "api")
    return base


def farm_run(url: str, instances: list[dict], batch: str) -> list[dict]:
    """Submit through the API app, wait for the batch; return the job docs."""
    from api import create_app

    app = create_app(load_settings(farm_env(url, POOLS)))
    client = app.test_client()
    resp = client.post("/v1/jobs", json={"handler": "synthetic", "instances": instances,
                                         "batch_id": batch})
    assert resp.status_code == 202, resp.get_json()
    wait_for(lambda: client.get(f"/v1/batches/{batch}").get_json()["complete"], 600, batch)
    return [client.get(f"/v1/jobs/{i}").get_json() for i in resp.get_json()["job_ids"]]


def ideal_makespan_s(n_jobs: int, stages: list[tuple[int, float]]) -> float:
    """Makespan of n jobs, all submitted at 0, through FIFO pools of (size, stage seconds)
    with zero overhead: the bound min(size / seconds), plus pipeline fill and drain."""
    ready = [0.0] * n_jobs
    for size, seconds in stages:
        free = [0.0] * size  # heap of the times each slot is next free
        done = []
        for t in sorted(ready):
            start = max(heapq.heappop(free), t)
            heapq.heappush(free, start + seconds)
            done.append(start + seconds)
        ready = done
    return max(ready)


def summarise(n_jobs: int, start: float, finishes: list[float],
              stages: list[tuple[int, float]]) -> dict:
    makespan = max(finishes) - start
    ideal = ideal_makespan_s(n_jobs, stages)
    return {"jobs": n_jobs, "bound": min(size / sec for size, sec in stages),
            "rate": n_jobs / makespan, "ideal_rate": n_jobs / ideal,
            "ratio": ideal / makespan}


def bench_stage_pools(url, tmp, n_jobs) -> dict:
    procs = Processes()
    try:
        start_farm(procs, url, POOLS, tmp)
        inst = {"init_s": STAGE_S["init"], "run_s": STAGE_S["run"], "eval_s": STAGE_S["eval"]}
        jobs = farm_run(url, [inst] * n_jobs, "bench-pools")
    finally:
        procs.stop()
    assert all(j["state"] == "done" for j in jobs)
    start = min(j["created_at"] for j in jobs)
    return summarise(n_jobs, start, [j["finished_at"] for j in jobs],
                     [(POOLS[s], STAGE_S[s]) for s in STAGE_S])


def bench_mono(url, tmp, n_jobs) -> dict:
    procs = Processes()
    r = redis.Redis.from_url(url, decode_responses=True)
    env = farm_env(url, {})
    try:
        procs.start([sys.executable, "-m", "celery", "-A", "bench.bare_chain", "worker", "-Q",
                     "mono", "-P", "threads", "-c", str(POOLS["init"]), "--without-gossip",
                     "--without-mingle", "--without-heartbeat", "-l", "WARNING"], env,
                    tmp / "mono.log")
        from bench.bare_chain import MONO_DONE, app

        app.conf.broker_url = url
        time.sleep(3)
        start = time.time()
        for i in range(n_jobs):
            app.send_task("bench.mono", args=[str(i), STAGE_S["init"], STAGE_S["run"],
                                              STAGE_S["eval"]], queue="mono")
        wait_for(lambda: r.llen(MONO_DONE) >= n_jobs, 600, "mono baseline")
        finishes = [float(x.split()[1]) for x in r.lrange(MONO_DONE, 0, -1)]
    finally:
        procs.stop()
    return summarise(n_jobs, start, finishes, [(POOLS["init"], sum(STAGE_S.values()))])


def bench_overhead_farm(url, tmp, n_jobs, n_latency, events: bool, round_: int = 0) -> dict:
    from api import create_app

    procs = Processes()
    pools = {"init": 8, "run": 8, "eval": 8}
    tag = ("ev" if events else "noev") + str(round_)
    try:
        start_farm(procs, url, pools, tmp, events)
        zero = {"init_s": 0, "run_s": 0, "eval_s": 0}
        jobs = farm_run(url, [zero] * n_jobs, f"bench-overhead-{tag}")
        client = create_app(load_settings(farm_env(url, pools))).test_client()
        lat = []
        for i in range(n_latency):
            jid = client.post("/v1/jobs", json={"handler": "synthetic", "instance": zero,
                                                "batch_id": f"lat{tag}{i}"}
                              ).get_json()["job_ids"][0]
            page = client.get(f"/v1/batches/lat{tag}{i}/results?wait=10").get_json()
            lat.append(page["results"][0]["timings"]["total_s"])
            assert page["results"][0]["id"] == jid
    finally:
        procs.stop()
    start = min(j["created_at"] for j in jobs)
    return {"rate": n_jobs / (max(j["finished_at"] for j in jobs) - start),
            "p50_ms": 1000 * pct(lat, 50), "p99_ms": 1000 * pct(lat, 99)}


def bench_overhead_bare(url, tmp, n_jobs, n_latency, events: bool = False) -> dict:
    from bench.bare_chain import DONE, app

    app.conf.broker_url = url
    procs = Processes()
    r = redis.Redis.from_url(url, decode_responses=True)
    env = farm_env(url, {})
    try:
        for hop in ("hop1", "hop2", "hop3"):
            procs.start([sys.executable, "-m", "celery", "-A", "bench.bare_chain", "worker",
                         "-Q", hop, "-P", "threads", "-c", "8", "--without-gossip",
                         "--without-mingle", "--without-heartbeat", "-l", "WARNING",
                         *(["-E"] if events else [])], env, tmp / f"{hop}.log")
        time.sleep(3)
        r.delete(DONE)
        start = time.time()
        for i in range(n_jobs):
            app.send_task("bench.hop1", args=[str(i)], queue="hop1")
        wait_for(lambda: r.llen(DONE) >= n_jobs, 300, "bare chain")
        end = max(float(x.split()[1]) for x in r.lrange(DONE, 0, -1))
        lat = []
        for i in range(n_latency):
            r.delete(DONE)
            t0 = time.time()
            app.send_task("bench.hop1", args=[f"l{i}"], queue="hop1")
            _, item = r.blpop(DONE, timeout=10)
            lat.append(float(item.split()[1]) - t0)
    finally:
        procs.stop()
    return {"rate": n_jobs / (end - start), "p50_ms": 1000 * pct(lat, 50),
            "p99_ms": 1000 * pct(lat, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=480, help="jobs for the stage-pool run")
    ap.add_argument("--mono-jobs", type=int, default=64, help="jobs for the mono baseline")
    ap.add_argument("--overhead-jobs", type=int, default=1000)
    ap.add_argument("--latency-jobs", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3,
                    help="overhead runs per setup, in turns (the median of each figure kept)")
    ap.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as d, private_redis() as url:
        tmp = Path(d)
        pools = bench_stage_pools(url, tmp, args.jobs)
        mono = bench_mono(url, tmp, args.mono_jobs)
        runs: dict[str, list[dict]] = {}
        for i in range(args.repeat):  # setups in turns: drift falls on all alike
            for name, run in (
                    ("farm", lambda i=i: bench_overhead_farm(url, tmp, args.overhead_jobs,
                                                         args.latency_jobs, True, i)),
                    ("quiet", lambda i=i: bench_overhead_farm(url, tmp, args.overhead_jobs,
                                                          args.latency_jobs, False, i)),
                    ("bare", lambda: bench_overhead_bare(url, tmp, args.overhead_jobs,
                                                         args.latency_jobs)),
                    ("bare_ev", lambda: bench_overhead_bare(url, tmp, args.overhead_jobs,
                                                            args.latency_jobs, True))):
                runs.setdefault(name, []).append(run())
        farm, quiet, bare, bare_ev = (
            {k: statistics.median(r[k] for r in runs[name]) for k in runs[name][0]}
            for name in ("farm", "quiet", "bare", "bare_ev"))

    lines = [
        f"### pipeline — {datetime.date.today().isoformat()} — {machine()}",
        "",
        f"Stage times INIT {STAGE_S['init']} s, RUN {STAGE_S['run']} s, EVAL "
        f"{STAGE_S['eval']} s; pools INIT {POOLS['init']}, RUN {POOLS['run']}, EVAL "
        f"{POOLS['eval']} (threads).",
        "",
        "| setup | jobs | bound (jobs/s) | ideal makespan rate | measured jobs/s "
        "| ratio to ideal |",
        "|---|---|---|---|---|---|",
        f"| stage pools (farm) | {pools['jobs']} | {pools['bound']:.2f} | "
        f"{pools['ideal_rate']:.2f} | {pools['rate']:.2f} | {pools['ratio']:.3f} |",
        f"| one pool, stages back to back | {mono['jobs']} | {mono['bound']:.2f} | "
        f"{mono['ideal_rate']:.2f} | {mono['rate']:.2f} | {mono['ratio']:.3f} |",
        "",
        "The ideal makespan rate is the bound with pipeline fill and drain counted (a zero-"
        "overhead simulation of the same pools and jobs); the ratio compares makespans.",
        f"Stage pools vs. one pool: **{pools['rate'] / mono['rate']:.2f}x** the throughput.",
        "",
        f"Overhead: each figure the median of {args.repeat} runs per setup, the setups "
        "in turns.",
        "",
        "| overhead (all stages 0 s) | jobs/s | latency p50 (ms) | latency p99 (ms) |",
        "|---|---|---|---|",
        f"| farm (API submit, job store, 3 pools; default settings) | {quiet['rate']:.1f} | "
        f"{quiet['p50_ms']:.1f} | {quiet['p99_ms']:.1f} |",
        f"| farm with Celery task events (as under `prorl-farm up`, for Flower) | "
        f"{farm['rate']:.1f} | {farm['p50_ms']:.1f} | {farm['p99_ms']:.1f} |",
        f"| bare 3-hop Celery chain | {bare['rate']:.1f} | {bare['p50_ms']:.1f} | "
        f"{bare['p99_ms']:.1f} |",
        f"| bare 3-hop Celery chain with task events | {bare_ev['rate']:.1f} | "
        f"{bare_ev['p50_ms']:.1f} | {bare_ev['p99_ms']:.1f} |",
        "",
        f"Farm / bare: throughput **{quiet['rate'] / bare['rate']:.2f}x** "
        f"({farm['rate'] / bare_ev['rate']:.2f}x, both with task events; "
        f"{farm['rate'] / bare['rate']:.2f}x farm with events against bare without), "
        f"p50 latency **{quiet['p50_ms'] / bare['p50_ms']:.2f}x** "
        f"({farm['p50_ms'] / bare_ev['p50_ms']:.2f}x with task events; "
        f"{farm['p50_ms'] / bare['p50_ms']:.2f}x against bare without).",
        "",
    ]
    report(lines, args.record)


if __name__ == "__main__":
    main()
