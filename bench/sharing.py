"""Sharing one farm between tenants: a flood by tenant A beside tenant B's batch, each
against the same work alone, and one tenant's throughput on its own.

    .venv/bin/python bench/sharing.py [--scenarios eval run single cpu] [--modes fifo fair]
                                      [--record]

A real farm (private redis-server, the three pools, the API under gunicorn) with two
tenants, each with its own key (``PRORL_TENANTS``), run once first come, first served
(``PRORL_FAIR_SHARE=0``, the baseline) and once with fair share. The work is the
``synthetic`` handler, whose stages hold a pool slot for a set time (sleeping: what is
measured is the order in which the farm hands out slots, not the CPU):

- ``eval``: A submits 64 jobs whose EVAL takes 4 s each (answers that are costly to
  check), then B submits 64 jobs of 0.05 s EVAL; B's batch time, against B alone.
- ``run``: A submits 1,000 jobs of 30 s RUN (long sandboxes), then B a 64-job step of
  0.5 s RUN; B's batch time against B alone (B's wait is cut at ``--cut-s``, and A's
  batch cancelled after).
- ``priority``: one tenant queues 8,192 jobs of 0.05 s INIT, then 8 of priority 1: how
  long those wait for INIT, and the 8,192 still completing.
- ``single``: one tenant, 8,192 jobs with every stage 0 s: jobs/s (the median of three).
- ``cpu``: A submits 64 ``code`` jobs whose grading burns CPU (4 s per test), then B 16
  honest ones; B's batch time against B alone, with the tenants' CPU groups off and on
  (``PRORL_TENANT_CPU``; root, cgroup v1).
- ``cost``: what Redis spends per job on the stage scripts (bench/stage_scripts.py drives
  8,192 jobs of one tenant through them as the pools would), for this tree with fair share
  on and off and for the tree before fair share (``--before``, a commit of this
  repository), in rounds (each run on a fresh private Redis, the order turning each round;
  the median of ``--rounds``, and of each round's ratio to the tree before).

The aims (issue: sharing one farm): B's batch within 2x its time alone in both floods; what
fair share costs a single tenant, at most 5% of its throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, private_redis, report  # noqa: E402
from bench.pipeline import Processes, start_farm_api  # noqa: E402
from prorl_farm.trainer import FarmClient  # noqa: E402

POOLS = {"init": 8, "run": 64, "eval": 8}
KEYS = {"a": "tenant-a-key-0123456789", "b": "tenant-b-key-0123456789"}
TENANTS = {"a": {"token": KEYS["a"]}, "b": {"token": KEYS["b"]}}


def timed_batch(farm: FarmClient, instance: dict, n: int, cut_s: float,
                handler: str = "synthetic", mode: str = "policy") -> float | None:
    """Submit ``n`` jobs of ``instance``; seconds until the batch is complete (None: not
    within ``cut_s``)."""
    t = time.monotonic()
    sub = farm.submit(handler, [instance], n=n, mode=mode)
    while time.monotonic() - t < cut_s:
        if farm.batch(sub["batch_id"])["complete"]:
            return time.monotonic() - t
        time.sleep(0.02)
    farm.cancel_batch(sub["batch_id"])
    return None


def flood(a: FarmClient, b: FarmClient, flood_job: dict, flood_n: int, step: dict,
          cut_s: float) -> dict:
    alone = timed_batch(b, step, 64, cut_s)
    sub = a.submit("synthetic", [flood_job], n=flood_n)
    time.sleep(1.0)  # A's jobs hold the stage's slots
    beside = timed_batch(b, step, 64, cut_s)
    a.cancel_batch(sub["batch_id"])
    return {"alone_s": alone, "beside_s": beside}


# The ``cpu`` scenario's work: ``code`` jobs graded on their own reference program (no
# policy), in the farm's grading sandboxes. A's program spends CPU_BURN_S of CPU before it
# answers, for each of its two tests (answers costly to check); B's answers at once.
CPU_BURN_S = 4.0
CPU_PROGRAM = ("import time\nt = time.process_time()\nwhile time.process_time() - t < {s}:\n"
               "    pass\nprint(2 * int(input()))\n")


def _code_job(burn_s: float) -> dict:
    return {"statement": "Double the number.", "tools": [], "time_limit_s": 30,
            "memory_mb": 256, "tests": [{"input": "2", "output": "4"},
                                        {"input": "21", "output": "42"}],
            "canonical_solution": CPU_PROGRAM.format(s=burn_s)}


def cpu_flood(a: FarmClient, b: FarmClient, n: int, cut_s: float) -> dict:
    """B's ``n`` honest code jobs alone, then beside A's 4n whose grading burns CPU."""
    def step() -> float | None:
        return timed_batch(b, _code_job(0.0), n, cut_s, "code", "reference")

    alone = step()
    sub = a.submit("code", [_code_job(CPU_BURN_S)], n=4 * n, mode="reference")
    time.sleep(5.0)  # A's graders are burning CPU
    beside = step()
    a.cancel_batch(sub["batch_id"])
    return {"alone_s": alone, "beside_s": beside}


def cpu_modes(cut_s: float, n: int = 16) -> dict:
    """The ``cpu`` scenario on a fresh farm with the tenants' CPU groups off (processes
    share the CPU one by one: the baseline) and on (PRORL_TENANT_CPU)."""
    out = {}
    for on in (False, True):
        tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-cpu-"))
        procs = Processes()
        os.environ["PRORL_TENANTS"] = json.dumps(TENANTS)
        os.environ["PRORL_TENANT_CPU"] = "1" if on else "0"
        try:
            with private_redis() as url:
                base = start_farm_api(procs, url, POOLS, tmp)
                a, b = (FarmClient(base, token=KEYS[t]) for t in ("a", "b"))
                timed_batch(b, _code_job(0.0), 4, cut_s, "code", "reference")  # warm-up
                out["groups" if on else "none"] = cpu_flood(a, b, n, cut_s)
                print("cpu", on, out, file=sys.stderr, flush=True)
                time.sleep(3)  # the cancelled flood's graders stop
        finally:
            procs.stop()
            shutil.rmtree(tmp, ignore_errors=True)
            os.environ.pop("PRORL_TENANT_CPU", None)
    return out


def redis_cost(url: str) -> tuple[float, int]:
    """Redis's CPU seconds so far and the commands it ran (those its scripts ran included)."""
    import redis

    r = redis.Redis.from_url(url)
    cpu = r.info("cpu")
    calls = sum(v["calls"] for k, v in r.info("commandstats").items()
                if k.startswith("cmdstat_"))
    r.close()
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"], calls


def single(farm: FarmClient, n: int = 8192, url: str = "") -> dict:
    cpu0, calls0 = redis_cost(url) if url else (0.0, 0)
    t = time.monotonic()
    sub = farm.submit("synthetic", [{}, {}], n=n // 2)  # at most 4,096 samples each
    while not farm.batch(sub["batch_id"])["complete"]:
        time.sleep(0.05)
    took = time.monotonic() - t
    cpu1, calls1 = redis_cost(url) if url else (0.0, 0)
    # What the client's polling costs is in it too (a few hundred calls over the run).
    return {"jobs": n, "jobs_per_s": n / took, "redis_cpu_us_per_job": (cpu1 - cpu0) / n * 1e6,
            "redis_commands_per_job": (calls1 - calls0) / n}


def priority(farm: FarmClient, n: int = 8192, init_s: float = 0.05) -> dict:
    """``n`` jobs of ``init_s`` INIT queued, then 8 of priority 1 from the same tenant: how
    long each of those waited for INIT (against one job's time: a slot frees every
    ``init_s / slots`` s), and the low-priority jobs' batch still completing."""
    low = farm.submit("synthetic", [{"init_s": init_s}] * 2, n=n // 2)["batch_id"]
    time.sleep(1.0)
    high = farm.submit("synthetic", [{"init_s": init_s}], n=8, priority=1)
    while not farm.batch(high["batch_id"])["complete"]:
        time.sleep(0.02)
    waits = sorted(farm.job(j)["timings"]["init"]["queue_wait_s"] for j in high["job_ids"])
    left = n - farm.batch(low)["counts"]["done"]
    t = time.monotonic()
    while not farm.batch(low)["complete"]:
        time.sleep(0.1)
    return {"job_s": init_s, "high_wait_first_s": waits[0], "high_wait_max_s": waits[-1],
            "low_left_when_high_done": left, "low_done_s_after": time.monotonic() - t,
            "low_done": farm.batch(low)["counts"]["done"]}


def _s(x: float | None, cut_s: float) -> str:
    return f"> {cut_s:g}" if x is None else f"{x:.2f}"


MODES = {"fifo": "first come, first served (PRORL_FAIR_SHARE=0)",
         "fair": "weighted fair share (the default)"}


def run_mode(mode: str, scenarios: list[str], cut_s: float) -> dict:
    """The scenarios on a fresh farm (its own Redis) with fair share on or off."""
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-sharing-"))
    procs = Processes()
    out: dict = {}
    os.environ["PRORL_TENANTS"] = json.dumps(TENANTS)
    os.environ["PRORL_FAIR_SHARE"] = "1" if mode == "fair" else "0"
    try:
        with private_redis() as url:
            base = start_farm_api(procs, url, POOLS, tmp)
            a, b = (FarmClient(base, token=KEYS[t]) for t in ("a", "b"))
            b.submit("synthetic", [{}], n=64)  # warm-up
            time.sleep(2)
            if "eval" in scenarios:
                out["eval"] = flood(a, b, {"eval_s": 4.0}, 64, {"eval_s": 0.05}, cut_s)
                print(mode, "eval", out["eval"], file=sys.stderr, flush=True)
            if "run" in scenarios:
                out["run"] = flood(a, b, {"run_s": 30.0}, 1000, {"run_s": 0.5}, cut_s)
                print(mode, "run", out["run"], file=sys.stderr, flush=True)
                time.sleep(5)  # the cancelled flood's jobs leave their slots
            if "priority" in scenarios:
                out["priority"] = priority(a)
                print(mode, "priority", out["priority"], file=sys.stderr, flush=True)
            if "single" in scenarios:
                runs = sorted((single(a, url=url) for _ in range(3)),
                              key=lambda x: x["jobs_per_s"])
                out["single"] = runs[1]
                print(mode, "single", out["single"], file=sys.stderr, flush=True)
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# The last commit before fair share: the per-job Redis cost it is held to (at most +10%).
BEFORE = "8778265"


def stage_cost(before: str, rounds: int, n: int = 8192) -> dict:
    """Median Redis CPU and commands per job through the stage scripts: ``before`` (that
    commit's tree, exported), this tree with fair share off (``fifo``) and on (``fair``)."""
    import statistics
    import subprocess


    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-cost-"))
    runs: dict[str, list[dict]] = {"before": [], "fifo": [], "fair": []}
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", before, "prorl_farm",
                                  "workers"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        modes = list(runs)
        for i in range(rounds):
            # Each run on a Redis of its own; the order turns each round.
            for mode in modes[i % 3:] + modes[:i % 3]:
                tree = tmp if mode == "before" else ROOT
                with private_redis() as url:
                    out = subprocess.run(
                        [sys.executable, str(ROOT / "bench" / "stage_scripts.py"), str(tree),
                         url, mode, str(n)], check=True, capture_output=True, text=True,
                        env={k: v for k, v in os.environ.items()
                             if not k.startswith("PRORL_")}).stdout
                runs[mode].append(json.loads(out.strip().splitlines()[-1]))
                print("cost", runs[mode][-1], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {mode: {k: statistics.median(x[k] for x in rs)
                  for k in ("redis_cpu_us_per_job", "redis_commands_per_job")}
           for mode, rs in runs.items()}
    for mode in ("fifo", "fair"):  # each round's own ratio, then their median
        out[mode]["paired"] = statistics.median(
            x["redis_cpu_us_per_job"] / b["redis_cpu_us_per_job"]
            for x, b in zip(runs[mode], runs["before"]))
    out["before"]["paired"] = 1.0
    return out


def _ratio(r: dict, cut_s: float) -> str:
    if r["beside_s"] and r["alone_s"]:
        return f"{r['beside_s'] / r['alone_s']:.1f}x"
    return f"> {cut_s / r['alone_s']:.0f}x" if r["alone_s"] else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="+",
                    default=["eval", "run", "priority", "single", "cost", "cpu"],
                    choices=["eval", "run", "priority", "single", "cost", "cpu"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--cut-s", type=float, default=90.0)
    ap.add_argument("--before", default=BEFORE, help="the commit the cost compares with")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    farm_scenarios = [s for s in args.scenarios if s not in ("cost", "cpu")]
    results = {mode: run_mode(mode, farm_scenarios, args.cut_s) for mode in args.modes
               } if farm_scenarios else {}
    costs = stage_cost(args.before, args.rounds) if "cost" in args.scenarios else None
    cpu = cpu_modes(args.cut_s) if "cpu" in args.scenarios else None
    lines = [f"### sharing — {date.today()} — {machine()}", "",
             f"Two tenants on one farm (pools {POOLS}, the fair share's reserve "
             "PRORL_FAIR_RESERVE=1; `synthetic` jobs holding their stage's slot for a set "
             f"time), each dispatch in the same run. B's wait is cut at {args.cut_s:g} s."]
    if {"eval", "run"} & set(args.scenarios):
        lines += ["", "| scenario | dispatch | B alone s | B beside A's flood s | "
                  "ratio (aim <= 2) |", "|---|---|---|---|---|"]
    for name, what in (("eval", "A: 64 jobs of 4 s EVAL; B: 64 of 0.05 s"),
                       ("run", "A: 1,000 jobs of 30 s RUN; B: 64 of 0.5 s")):
        for mode, out in results.items():
            if name in out:
                r = out[name]
                lines.append(f"| {name}: {what} | {mode} | {_s(r['alone_s'], args.cut_s)} | "
                             f"{_s(r['beside_s'], args.cut_s)} | {_ratio(r, args.cut_s)} |")
    prio = {m: out["priority"] for m, out in results.items() if "priority" in out}
    if prio:
        lines += ["", "Priority: 8,192 jobs of 0.05 s INIT queued by one tenant (8 INIT "
                  "slots: one job time per slot is 0.05 s), then 8 jobs of priority 1 from "
                  "the same tenant:", "",
                  "| dispatch | first high-priority job waited s | last waited s | "
                  "low-priority jobs still queued then | low-priority done |",
                  "|---|---|---|---|---|"]
        for m, p in prio.items():
            lines.append(f"| {m} | {p['high_wait_first_s']:.3f} | {p['high_wait_max_s']:.3f} "
                         f"| {p['low_left_when_high_done']} | {p['low_done']} of 8192 |")
    single_rates = {m: out["single"]["jobs_per_s"] for m, out in results.items()
                    if "single" in out}
    if single_rates:
        lines += ["", "One tenant alone, 8192 jobs of 0 s (median of 3): " + ", ".join(
            f"{m} **{v:.0f} jobs/s**" for m, v in single_rates.items())]
        if len(single_rates) == 2:
            ratio = single_rates["fair"] / single_rates["fifo"]
            lines[-1] += f"; fair share / fifo = **{ratio:.3f}** (aim >= 0.95)."
        cost = {m: out["single"] for m, out in results.items() if "single" in out}
        lines += ["", "Redis per job (that run): " + ", ".join(
            f"{m} {c['redis_commands_per_job']:.0f} commands and "
            f"{c['redis_cpu_us_per_job']:.0f} us of CPU" for m, c in cost.items())]
        if len(cost) == 2:
            fair, fifo = cost["fair"], cost["fifo"]
            calls = fair["redis_commands_per_job"] / fifo["redis_commands_per_job"]
            cpu = fair["redis_cpu_us_per_job"] / fifo["redis_cpu_us_per_job"]
            lines[-1] += f"; fair / fifo: commands {calls:.2f}x, CPU {cpu:.2f}x (aim <= 1.10)."
    if costs:
        b = costs["before"]
        lines += ["", f"Redis per job through the stage scripts alone (bench/stage_scripts.py: "
                  f"8,192 jobs of one tenant, 8 INIT / 64 RUN / 8 EVAL slots; median of "
                  f"{args.rounds} rounds, each run on a fresh Redis):", "",
                  "| tree | commands per job | Redis CPU us per job | CPU / before | "
                  "CPU / before, each round's (aim <= 1.10) |", "|---|---|---|---|---|"]
        names = {"before": f"before fair share ({args.before})",
                 "fifo": "this tree, PRORL_FAIR_SHARE=0", "fair": "this tree, fair share"}
        for mode, c in costs.items():
            lines.append(f"| {names[mode]} | {c['redis_commands_per_job']:.1f} | "
                         f"{c['redis_cpu_us_per_job']:.0f} | "
                         f"{c['redis_cpu_us_per_job'] / b['redis_cpu_us_per_job']:.3f} | "
                         f"{c['paired']:.3f} |")
    if cpu:
        lines += ["", f"CPU: A submits 64 `code` jobs whose grading burns {CPU_BURN_S:g} s of "
                  "CPU per test (two tests), B then 16 honest ones (reference mode, the "
                  "farm's grading sandboxes); B's batch beside A's against B alone, with "
                  "the tenants' CPU groups off (processes share the CPU one by one) and on "
                  "(PRORL_TENANT_CPU: cgroup v1 cpu.shares by weight, here 1:1):", "",
                  "| CPU groups | B alone s | B beside A's grading s | ratio (aim <= 2) |",
                  "|---|---|---|---|"]
        for mode, r in cpu.items():
            lines.append(f"| {mode} | {_s(r['alone_s'], args.cut_s)} | "
                         f"{_s(r['beside_s'], args.cut_s)} | {_ratio(r, args.cut_s)} |")
    report(lines + [""], args.record)


if __name__ == "__main__":
    main()
