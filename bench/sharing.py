"""Sharing one farm between tenants: a flood by tenant A beside tenant B's batch, each
against the same work alone, and one tenant's throughput on its own.

    .venv/bin/python bench/sharing.py [--scenarios eval run single] [--record]

A real farm (private redis-server, the three pools, the API under gunicorn) with two
tenants, each with its own key (``PRORL_TENANTS``). The work is the ``synthetic`` handler,
whose stages hold a pool slot for a set time (sleeping: what is measured is the order in
which the farm hands out slots, not the CPU):

- ``eval``: A submits 64 jobs whose EVAL takes 4 s each (answers that are costly to
  check), then B submits 64 jobs of 0.05 s EVAL; B's batch time, against B alone.
- ``run``: A submits 1,000 jobs of 30 s RUN (long sandboxes), then B a 64-job step of
  0.5 s RUN; B's batch time against B alone (B's wait is cut at ``--cut-s``, and A's
  batch cancelled after).
- ``single``: one tenant, 8,192 jobs with every stage 0 s: jobs/s.

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


def timed_batch(farm: FarmClient, instance: dict, n: int, cut_s: float) -> float | None:
    """Submit ``n`` jobs of ``instance``; seconds until the batch is complete (None: not
    within ``cut_s``)."""
    t = time.monotonic()
    sub = farm.submit("synthetic", [instance], n=n)
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


def single(farm: FarmClient, n: int = 8192) -> dict:
    t = time.monotonic()
    sub = farm.submit("synthetic", [{}, {}], n=n // 2)  # at most 4,096 samples each
    while not farm.batch(sub["batch_id"])["complete"]:
        time.sleep(0.05)
    return {"jobs": n, "jobs_per_s": n / (time.monotonic() - t)}


def _s(x: float | None, cut_s: float) -> str:
    return f"> {cut_s:g}" if x is None else f"{x:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="+", default=["eval", "run", "single"],
                    choices=["eval", "run", "single"])
    ap.add_argument("--cut-s", type=float, default=90.0)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-sharing-"))
    procs = Processes()
    out: dict = {}
    os.environ["PRORL_TENANTS"] = json.dumps(TENANTS)
    try:
        with private_redis() as url:
            base = start_farm_api(procs, url, POOLS, tmp)
            a, b = (FarmClient(base, token=KEYS[t]) for t in ("a", "b"))
            b.submit("synthetic", [{}], n=64)  # warm-up
            time.sleep(2)
            if "eval" in args.scenarios:
                out["eval"] = flood(a, b, {"eval_s": 4.0}, 64, {"eval_s": 0.05}, args.cut_s)
                print("eval", out["eval"], file=sys.stderr, flush=True)
            if "run" in args.scenarios:
                out["run"] = flood(a, b, {"run_s": 30.0}, 1000, {"run_s": 0.5}, args.cut_s)
                print("run", out["run"], file=sys.stderr, flush=True)
                time.sleep(5)  # the cancelled flood's jobs leave their slots
            if "single" in args.scenarios:
                out["single"] = single(a)
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [f"### sharing — {date.today()} — {machine()}", "",
             f"Two tenants on one farm (pools {POOLS}; `synthetic` jobs holding their "
             "stage's slot for a set time), the dispatch as this farm has it (each stage's "
             f"queue first come, first served). B's wait is cut at {args.cut_s:g} s.", "",
             "| scenario | B alone s | B beside A's flood s | ratio (aim <= 2) |",
             "|---|---|---|---|"]
    for name, what in (("eval", "A: 64 jobs of 4 s EVAL; B: 64 of 0.05 s"),
                       ("run", "A: 1,000 jobs of 30 s RUN; B: 64 of 0.5 s")):
        if name in out:
            r = out[name]
            ratio = (f"{r['beside_s'] / r['alone_s']:.1f}x" if r["beside_s"] and r["alone_s"]
                     else f"> {args.cut_s / r['alone_s']:.0f}x" if r["alone_s"] else "-")
            lines.append(f"| {name}: {what} | {_s(r['alone_s'], args.cut_s)} | "
                         f"{_s(r['beside_s'], args.cut_s)} | {ratio} |")
    if "single" in out:
        lines += ["", f"One tenant alone, {out['single']['jobs']} jobs of 0 s: "
                      f"**{out['single']['jobs_per_s']:.0f} jobs/s**."]
    report(lines + [""], args.record)


if __name__ == "__main__":
    main()
