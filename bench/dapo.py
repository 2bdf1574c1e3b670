"""Dynamic sampling: time per training batch and rollouts wasted, three ways, in one run.

    .venv/bin/python bench/dapo.py [--steps 4] [--groups 8] [--n 8] [--record]

A real farm (private redis-server, the three pools, the API under gunicorn) runs
`synthetic` rollouts whose times are heavy-tailed (log-normal, median 0.3 s, capped at
8 s) and about half of whose prompts have rewards that all agree (no signal). Each step
wants ``--groups`` groups with varying rewards:

(a) naive: submit that many groups, wait for every rollout, filter, resubmit the missing
    number, until the step is full;
(b) asynchronous replenishment (`DynamicSampler`, carry=False): keep enough groups in
    flight, take groups as they finish, cancel the surplus;
(c) the same with carry-over (carry=True, staleness 1).
"""

from __future__ import annotations

import argparse
import random
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
from prorl_farm.trainer.dapo import DynamicSampler  # noqa: E402

POOLS = {"init": 16, "run": 96, "eval": 16}


def prompts(seed: int):
    rng = random.Random(seed)
    while True:
        run_s = min(8.0, rng.lognormvariate(-1.2, 1.0))
        if rng.random() < 0.5:
            yield {"run_s": run_s, "rewards": [float(rng.random() < 0.5)]}  # all agree
        else:
            yield {"run_s": run_s, "rewards": [0.0, 1.0, 1.0, 0.0, 1.0]}


def naive(farm: FarmClient, source, groups: int, n: int, steps: int, train_s: float
          ) -> list[dict]:
    out = []
    for _ in range(steps):
        time.sleep(train_s)
        t0, wasted, accepted = time.monotonic(), 0, 0
        while accepted < groups:
            batch = [next(source) for _ in range(groups - accepted)]
            sub = farm.submit("synthetic", batch, n=n)
            by_prompt: dict[int, list[float]] = {}
            for job in farm.iter_results(sub["batch_id"]):
                by_prompt.setdefault(job["instance_index"], []).append(job["reward"])
            for rewards in by_prompt.values():
                if len(set(rewards)) > 1 and None not in rewards:
                    accepted += 1
                else:
                    wasted += n
        out.append({"s": time.monotonic() - t0, "wasted": wasted})
    return out


def dynamic(farm: FarmClient, source, groups: int, n: int, steps: int, train_s: float,
            carry: bool) -> list[dict]:
    out = []
    with DynamicSampler(farm, source, "synthetic", n=n, batch_groups=groups, carry=carry,
                        staleness=1, poll_wait_s=0.2) as sampler:
        for step in range(steps):
            time.sleep(train_s)  # the trainer's update: carried rollouts keep running
            t0 = time.monotonic()
            batch = sampler.next_batch(policy_version=step)
            assert len(batch) == groups
            out.append({"s": time.monotonic() - t0, "wasted": batch.stats.rollouts_wasted})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--train-s", type=float, default=1.0,
                    help="the trainer's update between steps (not counted as batch time)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-dapo-"))
    procs = Processes()
    try:
        with private_redis() as url:
            farm = FarmClient(start_farm_api(procs, url, POOLS, tmp))
            results = {
                "naive": naive(farm, prompts(1), args.groups, args.n, args.steps,
                               args.train_s),
                "replenish": dynamic(farm, prompts(1), args.groups, args.n, args.steps,
                                     args.train_s, carry=False),
                "carry": dynamic(farm, prompts(1), args.groups, args.n, args.steps,
                                 args.train_s, carry=True),
            }
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    mean = {k: sum(r["s"] for r in v) / len(v) for k, v in results.items()}
    wasted = {k: sum(r["wasted"] for r in v) / len(v) for k, v in results.items()}
    lines = [
        f"### dapo — {date.today()} — {machine()}", "",
        f"{args.steps} steps of {args.groups} groups x n={args.n} with varying rewards; "
        "`synthetic` rollouts, run time log-normal (median 0.3 s, capped 8 s), about half "
        f"the prompts without signal; {args.train_s:g} s of training between steps (not "
        f"counted); pools {POOLS}:", "",
        "| strategy | time per batch (s) | rollouts wasted per batch |", "|---|---|---|",
        *[f"| {k} | {mean[k]:.2f} | {wasted[k]:.1f} |" for k in results], "",
        f"Naive / asynchronous replenishment: **{mean['naive'] / mean['replenish']:.2f}x**; "
        f"naive / with carry-over: **{mean['naive'] / mean['carry']:.2f}x**.", "",
    ]
    report(lines, args.record)


if __name__ == "__main__":
    main()
