"""Trajectories at production size: a step of long rollouts through a real farm, their
arrays in the trajectory store, fetched by a trainer as JSON and as the Arrow stream.

    .venv/bin/python bench/trajectories.py [--jobs 8192] [--tokens 32768] [--json-jobs 512]
                                           [--record]

``synthetic`` fabricates each rollout (``--tokens`` response tokens in 8 turns after a
512-token prompt: int ids, mask, float32 logprobs) in RUN; the farm stores it, EVAL reads
it back, the job finishes. Measured: Redis memory per finished job (used_memory over the
step, less before), the store's bytes per token, and the trainer's fetch + decode of the
whole step through ``FarmClient`` on the binary path (numpy arrays), against the JSON path
(lists) on the first ``--json-jobs`` rollouts of the same step in the same run (a whole
step of JSON does not fit this machine's memory as Python lists), with the JSON step's
time projected from them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from datetime import date
from pathlib import Path

import redis
from common import machine, private_redis, report  # noqa: E402
from pipeline import Processes, start_farm_api, wait_for  # noqa: E402

from prorl_farm.trainer import FarmClient  # noqa: E402

POOLS = {"init": 4, "run": 8, "eval": 4}
PROMPT, TURNS = 512, 8
PAGE = 128


def _fetch(client: FarmClient, batch: str, limit: int | None, binary: bool
           ) -> tuple[float, int, int]:
    """Fetch and decode the batch's results (the first ``limit``) the way a trainer does,
    through ``FarmClient.iter_results``: (seconds, jobs, tokens)."""
    t0 = time.perf_counter()
    jobs = tokens = 0
    for job in client.iter_results(batch, expected=limit, wait_s=0, page_size=PAGE,
                                   binary=binary):
        jobs += 1
        tokens += len(job["result"]["response_ids"]) + len(job["result"]["prompt_ids"])
    return time.perf_counter() - t0, jobs, tokens


def run(url: str, n: int, tokens: int, json_jobs: int, tmp: Path) -> dict:
    procs = Processes()
    store = tmp / "store"
    store.mkdir()
    env_extra = {"PRORL_STORE_DIR": str(store), "PRORL_STORE_MIN_FREE_MB": "256",
                 "PRORL_RUN_TIMEOUT_S": "3600"}
    os.environ.update(env_extra)  # the pools and the API take them from the environment
    try:
        base = start_farm_api(procs, url, POOLS, tmp)
        r = redis.Redis.from_url(url, decode_responses=True)
        client = FarmClient(base, timeout_s=300)
        warm = client.submit("synthetic", [{"trajectory_tokens": 64}], n=8)
        wait_for(lambda: client.batch(warm["batch_id"])["complete"], 60, "warm-up")
        for binary in (True, False):  # every API process and path warm before it counts
            for _ in range(4):
                _fetch(client, warm["batch_id"], None, binary)
        mem0 = int(r.info("memory")["used_memory"])
        t0 = time.monotonic()
        group = min(n, 16)  # prompts x samples, as a step is made of
        instance = {"trajectory_tokens": tokens, "prompt_tokens": PROMPT,
                    "trajectory_turns": TURNS}
        sub = client.submit("synthetic", [instance] * (n // group), n=group)
        batch = sub["batch_id"]
        wait_for(lambda: client.batch(batch)["complete"], 6 * 3600, "the step")
        make_s = time.monotonic() - t0
        summary = client.batch(batch)
        assert summary["counts"]["done"] == n, summary
        mem1 = int(r.info("memory")["used_memory"])
        store_bytes = sum(p.stat().st_size for p in store.glob(f"b-{batch}/*.arrow"))
        one = client.job(sub["job_ids"][0])
        json_doc_bytes = len(json.dumps(one["result"]))

        bin_s, bin_jobs, bin_tokens = _fetch(client, batch, None, True)
        sub_bin_s, _, _ = _fetch(client, batch, json_jobs, True)
        json_s, got_json, json_tokens = _fetch(client, batch, json_jobs, False)
        assert bin_jobs == n and bin_tokens == n * (tokens + PROMPT), (bin_jobs, bin_tokens)
        t_ack = time.perf_counter()
        acked = client.ack(batch)
        ack_s = time.perf_counter() - t_ack
        assert acked["payloads_deleted"] == n, acked
        job_hash = r.memory_usage(f"prorl:job:{sub['job_ids'][0]}")
        client.http.close()
        r.close()
        return {"jobs": n, "tokens": tokens, "make_s": make_s,
                "redis_bytes_per_job": (mem1 - mem0) / n, "job_hash": job_hash,
                "store_bytes": store_bytes, "bytes_per_token": store_bytes / (n * (tokens +
                                                                                  PROMPT)),
                "json_doc_bytes": json_doc_bytes, "bin_s": bin_s, "sub_bin_s": sub_bin_s,
                "json_s": json_s, "json_jobs": got_json, "json_tokens": json_tokens,
                "ack_s": ack_s}
    finally:
        procs.stop()
        for k in env_extra:
            os.environ.pop(k, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=8192, help="a multiple of 16")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--json-jobs", type=int, default=512)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-traj-"))
    try:
        with private_redis() as url:
            x = run(url, args.jobs, args.tokens, min(args.json_jobs, args.jobs), tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(x, flush=True)
    per_job_json = x["json_s"] / x["json_jobs"]
    per_job_bin = x["sub_bin_s"] / x["json_jobs"]
    step_json = per_job_json * x["jobs"]
    lines = [
        f"### trajectories — {date.today()} — {machine()}", "",
        f"{x['jobs']} `synthetic` rollouts of {x['tokens']} response tokens ({TURNS} turns, a "
        f"{PROMPT}-token prompt) through a real farm (pools {POOLS}, the API under gunicorn, "
        f"a private Redis), made in {x['make_s']:.0f} s; fetched page by page ({PAGE} jobs) "
        "through `FarmClient.iter_results` (the next page fetched while the caller works "
        "through one).", "",
        "| measure | value |", "|---|---|",
        f"| Redis memory per finished job | **{x['redis_bytes_per_job']:.0f} B** (used_memory "
        f"over the step; of it the job's hash: {x['job_hash']} B) |",
        f"| the same job's result as JSON (what Redis held before this store) | "
        f"{x['json_doc_bytes'] / 1e6:.2f} MB |",
        f"| trajectory store | {x['store_bytes'] / 1e9:.2f} GB, "
        f"**{x['bytes_per_token']:.2f} bytes per token** |",
        f"| fetch + decode, Arrow, the whole step | **{x['bin_s']:.1f} s** "
        f"({x['jobs'] * (x['tokens'] + PROMPT) / x['bin_s'] / 1e6:.0f} M tokens/s) |",
        f"| fetch + decode, first {x['json_jobs']}: Arrow / JSON | {x['sub_bin_s']:.2f} s / "
        f"{x['json_s']:.2f} s: **JSON {per_job_json / per_job_bin:.0f}x slower** |",
        f"| fetch + decode, JSON, the whole step (projected from the {x['json_jobs']}) | "
        f"{step_json:.0f} s |",
        f"| ack of the step (payloads deleted) | {x['ack_s']:.2f} s |", "",
    ]
    report(lines, args.record)


if __name__ == "__main__":
    main()
