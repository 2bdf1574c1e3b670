"""NeMo Gym's ``/run`` against the farm's own API: 512 rows through the farm's Gym agent
server at 128 in flight, against the same 512 jobs submitted through the API, in one run.

    .venv/bin/python bench/gym.py [--rows 512] [--in-flight 128] [--record]

A real farm (private redis-server, the three pools, the API under gunicorn, the CPU dev
model server with the tiny model as its backend) and `prorl-farm gym` in front of it. The
rows are Gym rows of a ``chat`` task graded ``contains`` (one model call of up to 16 tokens,
no sandbox): what is measured is the farm and the way in, not a model. The API run submits
the same instances as one batch and long-polls its results, as a trainer does.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, pct, private_redis, report  # noqa: E402
from bench.pipeline import Processes, farm_env, start_farm_api, wait_for  # noqa: E402
from prorl_farm.supervisor import free_port  # noqa: E402
from prorl_farm.trainer import FarmClient  # noqa: E402

POOLS = {"init": 16, "run": 128, "eval": 16}
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16}


def row(i: int) -> dict:
    return {"responses_create_params": {
        "input": [{"role": "user", "content": f"Say a word ({i})."}],
        "temperature": 1.0, "top_p": 1.0, "max_output_tokens": 16},
        "expected_answer": "e", "prorl_grader": "contains"}


def through_gym(base: str, rows: list[dict], in_flight: int) -> tuple[float, list[float]]:
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=in_flight)
    session.mount("http://", adapter)

    def one(r: dict) -> float:
        t0 = time.perf_counter()
        resp = session.post(base + "/run", json=r, timeout=600)
        resp.raise_for_status()
        assert resp.json()["mask_sample"] is False, resp.json().get("failure_reason")
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        times = list(pool.map(one, rows))
    return time.perf_counter() - t0, times


def _instances(rows: list[dict]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": r["responses_create_params"][
        "input"][0]["content"]}], "answer": "e"} for r in rows]


def through_api(farm: FarmClient, rows: list[dict]) -> float:
    """All at once: one batch, its results long-polled (how a trainer submits a step)."""
    t0 = time.perf_counter()
    sub = farm.submit("chat", _instances(rows), sampling=SAMPLING)
    jobs = list(farm.iter_results(sub["batch_id"], progress=None))
    assert len(jobs) == len(rows) and all(j["state"] == "done" for j in jobs)
    return time.perf_counter() - t0


def through_api_window(farm: FarmClient, rows: list[dict], in_flight: int) -> float:
    """``in_flight`` at a time, as /run keeps them: each finished job replaced at once (the
    replacements of one results page in one submit), results long-polled across batches."""
    todo = _instances(rows)
    cursors: dict[str, str] = {}
    left: dict[str, int] = {}
    done = 0

    def submit(k: int) -> None:
        nonlocal todo
        if k <= 0 or not todo:
            return
        batch, todo = todo[:k], todo[k:]
        sub = farm.submit("chat", batch, sampling=SAMPLING)
        cursors[sub["batch_id"]], left[sub["batch_id"]] = "0-0", len(batch)

    t0 = time.perf_counter()
    submit(in_flight)
    while done < len(rows):
        pages = farm.results_many(dict(cursors), limit=1000, wait_s=5.0)
        finished = 0
        for batch_id, page in pages.items():
            assert all(j["state"] == "done" for j in page["results"])
            finished += len(page["results"])
            cursors[batch_id] = page["cursor"]
            left[batch_id] -= len(page["results"])
            if not left[batch_id]:
                del cursors[batch_id], left[batch_id]
        done += finished
        submit(finished)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--in-flight", type=int, default=128)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-gym-"))
    procs = Processes()
    try:
        from prorl_farm.dev.tiny import build_tiny_model

        model = build_tiny_model(tmp / "model")
        with private_redis() as url:
            base = start_farm_api(procs, url, POOLS, tmp)
            farm = FarmClient(base)
            env = farm_env(url, POOLS, events=False)
            model_port, gym_port = free_port(), free_port()
            procs.start([sys.executable, "-m", "prorl_farm.cli", "serve-model", "--model",
                         str(model), "--port", str(model_port)], env, tmp / "model.log")
            model_url = f"http://127.0.0.1:{model_port}"
            wait_for(lambda: _ok(model_url + "/health"), 120, "dev model")
            farm.register_backend(model_url, "vllm", model.name, str(model), capacity=128)
            procs.start([sys.executable, "-m", "prorl_farm.cli", "gym", "--port",
                         str(gym_port), "--farm", base], env, tmp / "gym.log")
            gym = f"http://127.0.0.1:{gym_port}"
            wait_for(lambda: _ok(gym + "/healthz"), 30, "gym server")
            rows = [row(i) for i in range(args.rows)]
            through_gym(gym, rows[:32], 32)  # warm-up: the pools' first jobs, the model
            api_s = through_api(farm, rows)
            window_s = through_api_window(farm, rows, args.in_flight)
            gym_s, times = through_gym(gym, rows, args.in_flight)
            window_s2 = through_api_window(farm, rows, args.in_flight)  # again: drift
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    window = statistics.fmean([window_s, window_s2])
    lines = [
        f"### gym — {date.today()} — {machine()}", "",
        f"{args.rows} NeMo Gym rows through the farm's Gym agent server (`/run`, "
        f"{args.in_flight} in flight), against the same {args.rows} jobs through the farm's "
        f"API with {args.in_flight} in flight (each finished job replaced at once; run before "
        "and after the `/run` run) and all at once (one batch, long-polled), in one run; one "
        "`chat` model call of up to 16 tokens each on the CPU dev model server; pools "
        f"{POOLS}.", "",
        "| path | wall s | per row ms | row latency p50 / p99 s |", "|---|---|---|---|",
        f"| the farm's API, {args.in_flight} in flight (before / after) | "
        f"{window_s:.2f} / {window_s2:.2f} | {1000 * window / args.rows:.1f} | |",
        f"| Gym `/run`, {args.in_flight} in flight | {gym_s:.2f} | "
        f"{1000 * gym_s / args.rows:.1f} | {pct(times, 50):.2f} / {pct(times, 99):.2f} |",
        f"| the farm's API, all at once | {api_s:.2f} | {1000 * api_s / args.rows:.1f} | |",
        "",
        f"`/run` over the API at the same concurrency: **{gym_s / window:.2f}x** (the aim: "
        f"at most 1.1x); over all at once: {gym_s / api_s:.2f}x.", "",
    ]
    report(lines, args.record)


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except OSError:
        return False


if __name__ == "__main__":
    main()
