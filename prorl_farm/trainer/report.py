"""Following a batch from the command line: a progress bar while it runs, then a summary
(mean reward, pass@k per instance, failures by kind, end reasons), optionally the finished
jobs written out as JSON Lines."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from math import comb

from prorl_farm.columns import json_default
from prorl_farm.trainer.farm import FarmClient


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate for one instance: n samples, c correct."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarise(jobs: list[dict]) -> dict:
    states = Counter(j["state"] for j in jobs)
    failures = Counter((j.get("failure") or {}).get("kind") for j in jobs
                       if j["state"] != "done")
    reasons = Counter(((j.get("result") or {}).get("stats") or {}).get("end_reason")
                      for j in jobs if j["state"] == "done")
    rewards = [j["reward"] for j in jobs if j["state"] == "done" and j["reward"] is not None]
    per_instance: dict[int, list[float]] = defaultdict(list)
    for j in jobs:
        per_instance[j["instance_index"]].append(
            1.0 if j["state"] == "done" and (j["reward"] or 0) >= 1.0 else 0.0)
    n = min((len(v) for v in per_instance.values()), default=0)
    passes = {}
    for k in sorted({1, n} - {0}):
        passes[f"pass@{k}"] = round(sum(pass_at_k(len(v), int(sum(v)), k)
                                        for v in per_instance.values())
                                    / max(1, len(per_instance)), 4)
    return {"jobs": len(jobs), "states": dict(states),
            "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
            **passes, "failures": {k: v for k, v in failures.items() if k},
            "end_reasons": {k: v for k, v in reasons.items() if k}}


def follow(farm: FarmClient, batch_id: str, output: str | None = None,
           progress: bool = True) -> dict:
    """Stream the batch's results until it is complete; returns the summary."""
    jobs = []
    out = open(output, "w") if output else None  # noqa: SIM115 - closed below
    try:
        # The bar where stderr is a terminal (None), never when progress is off.
        for job in farm.iter_results(batch_id, wait_s=10.0,
                                     progress=None if progress else False):
            jobs.append(job)
            if out is not None:
                out.write(json.dumps(job, default=json_default) + "\n")
    finally:
        if out is not None:
            out.close()
    return summarise(jobs)
