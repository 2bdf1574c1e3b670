"""Weight updates in place vs drain, with heavy-tailed turns, in one run.

    .venv/bin/python bench/weight_sync.py [--median 48] [--tails 10,20] [--record]

A real farm (private redis-server, the three pools, the API under gunicorn) and the farm's
dev model server (a tiny Qwen2 on the CPU, registered as a vLLM backend). `synthetic` jobs
make one LLM turn each of ``--median`` tokens, one sample in eight ``tail`` times as long.

1. Time to new weights: with the batch generating (the long turns under way), a trainer
   asks for an update (the same checkpoint, next version, checked against a probe). A
   client polls the engine with one-token requests and notes when the first token comes
   back labelled with the new version; the update call's own time is noted too. ``drain``
   waits for every job pinned to the backend (the longest turn), ``in_place`` pauses the
   engine, loads, resumes the turns where they were.
2. A DAPO run: `DynamicSampler` with carry-over (staleness 1), groups of 8 with the same
   heavy tail, a simulated update (``--train-s``) and a sync after every step; time per
   step (sampling + sync), drain vs in place.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, private_redis, report  # noqa: E402
from bench.pipeline import Processes, start_farm_api, wait_for  # noqa: E402
from prorl_farm.trainer import FarmClient  # noqa: E402
from prorl_farm.trainer.dapo import DynamicSampler  # noqa: E402

POOLS = {"init": 16, "run": 64, "eval": 16}
N = 16  # jobs in flight for part 1 (two of them long)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _running(engine: str) -> int:
    with urllib.request.urlopen(engine + "/get_model_info", timeout=10) as resp:
        return int(json.loads(resp.read())["running"])


def probe_of(model_dir: Path) -> dict:
    """Token ids and the checkpoint's logprob of each after the first (the check's probe)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = list(range(3, 40))
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return {"token_ids": ids, "logprobs": [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]}


def instance(median: int, tail: int, **extra) -> dict:
    """One LLM turn of ``median`` tokens; sample 8k+7 makes one ``tail`` times as long."""
    return {"llm_turns": 1, "llm_tokens": median,
            "sample_overrides": [{}] * 7 + [{"llm_tokens": median * tail}], **extra}


class FirstNewToken(threading.Thread):
    """Polls the engine with one-token requests; ``at``: when the first token labelled
    ``version`` (checked or not) came back."""

    def __init__(self, engine: str, version: int):
        super().__init__(daemon=True)
        self.engine, self.version, self.at, self.stop = engine, str(version), None, False

    def run(self) -> None:
        while not self.stop and self.at is None:
            doc = _post(self.engine + "/inference/v1/generate", {
                "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1}})
            spans = doc["choices"][0].get("weight_versions") or []
            if any(str(s["version"]).split(":")[0] == self.version for s in spans):
                self.at = time.monotonic()
            time.sleep(0.02)  # light: the probes share the engine with the batch


def time_to_new_weights(farm: FarmClient, engine: str, backend: str, model_dir: Path,
                        probe: dict, mode: str, median: int, tail: int, version: int) -> dict:
    sub = farm.submit("synthetic", [instance(median, tail)], n=N)
    wait_for(lambda: _running(engine) >= N * 3 // 4, 60, "turns generating")
    t_start = time.monotonic()
    # The short turns end; the long ones are under way.
    wait_for(lambda: farm.batch(sub["batch_id"])["finished"] >= N - N // 8, 300,
             "the short turns done")
    watch = FirstNewToken(engine, version)
    t0 = time.monotonic()
    watch.start()
    farm.sync_weights(str(model_dir), version, backend_id=backend, probe=probe, mode=mode,
                      drain_timeout_s=600)
    call_s = time.monotonic() - t0
    jobs = list(farm.iter_results(sub["batch_id"], timeout_s=600))
    t_end = time.monotonic()
    watch.join(60)
    watch.stop = True
    assert all(j["state"] == "done" for j in jobs), [j["failure"] for j in jobs]
    return {"mode": mode, "tail": tail, "first_new_s": watch.at - t0, "call_s": call_s,
            "longest_left_s": t_end - t0, "long_turn_s": t_end - t_start}


def dapo(farm: FarmClient, backend: str, model_dir: Path, probe: dict, mode: str,
         median: int, tail: int, steps: int, train_s: float, version: int) -> dict:
    prompts = (instance(median, tail, rewards=[0.0, 1.0, 1.0, 0.0]) for _ in range(10_000))
    step_s, sync_s = [], []
    with DynamicSampler(farm, prompts, "synthetic", n=8, batch_groups=4, carry=True,
                        staleness=1, poll_wait_s=0.1, max_groups_in_flight=8,
                        overprovision=2.0) as sampler:  # 8 in flight: some carried
        for step in range(steps):
            t0 = time.monotonic()
            batch = sampler.next_batch(policy_version=version + step)
            assert len(batch) == 4
            time.sleep(train_s)  # the trainer's update; carried rollouts keep running
            t1 = time.monotonic()
            farm.sync_weights(str(model_dir), version + step + 1, backend_id=backend,
                              probe=probe, mode=mode, drain_timeout_s=600)
            sync_s.append(time.monotonic() - t1)
            step_s.append(time.monotonic() - t0 - train_s)
    return {"step_s": sum(step_s) / steps, "sync_s": sum(sync_s) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--median", type=int, default=64, help="tokens of a median turn")
    ap.add_argument("--tails", default="10,20,40", help="long turns, times the median")
    ap.add_argument("--steps", type=int, default=3, help="DAPO steps per mode")
    ap.add_argument("--train-s", type=float, default=0.5)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    from prorl_farm.dev.tiny import build_tiny_model
    from prorl_farm.supervisor import free_port

    tails = [int(t) for t in args.tails.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-sync-"))
    procs = Processes()
    rows, steps = [], {}
    try:
        model_dir = build_tiny_model(tmp / "model")
        probe = probe_of(model_dir)
        port = free_port()
        engine = f"http://127.0.0.1:{port}"
        procs.start([sys.executable, "-m", "prorl_farm.cli", "serve-model", "--model",
                     str(model_dir), "--port", str(port)], None, tmp / "engine.log")
        with private_redis() as url:
            farm = FarmClient(start_farm_api(procs, url, POOLS, tmp))
            wait_for(lambda: _ok(engine), 120, "the dev model server")
            backend = farm.register_backend(engine, "vllm", "tiny", str(model_dir),
                                            capacity=64, policy_version=0)["id"]
            version = 1
            for tail in tails:
                for mode in ("drain", "in_place"):
                    rows.append(time_to_new_weights(farm, engine, backend, model_dir, probe,
                                                    mode, args.median, tail, version))
                    print(rows[-1], file=sys.stderr)
                    version += 1
            for mode in ("drain", "in_place"):
                steps[mode] = dapo(farm, backend, model_dir, probe, mode, args.median,
                                   20, args.steps, args.train_s, version)
                print(mode, steps[mode], file=sys.stderr)
                version += args.steps + 1
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    by = {(r["tail"], r["mode"]): r for r in rows}
    lines = [
        f"### weight_sync — {date.today()} — {machine()}", "",
        f"Dev model server (tiny Qwen2, CPU), {N} `synthetic` jobs of one turn: {args.median} "
        "tokens, one in eight `tail` times as long. The update (same checkpoint, next "
        "version, checked against a probe) is asked for once the short turns are done and "
        "the long ones under way.", "",
        "| tail | mode | first token under the new weights (s) | update call (s) | "
        "longest turn in flight, from the request (s) |", "|---|---|---|---|---|",
        *[f"| {r['tail']}x | {r['mode']} | {r['first_new_s']:.2f} | {r['call_s']:.2f} | "
          f"{r['longest_left_s']:.2f} |" for r in rows], "",
        *[f"Tail {t}x: drain / in place, time to new weights: **"
          f"{by[(t, 'drain')]['first_new_s'] / by[(t, 'in_place')]['first_new_s']:.1f}x**."
          for t in tails], "",
        f"DAPO with carry-over (staleness 1): {args.steps} steps of 4 groups x 8 (8 groups "
        f"kept in flight), tail 20x, {args.train_s:g} s of training between steps (not "
        "counted); a sync after every step:", "",
        "| sync | time per step, sampling + sync (s) | sync (s) |", "|---|---|---|",
        *[f"| {m} | {v['step_s']:.2f} | {v['sync_s']:.2f} |" for m, v in steps.items()], "",
        f"Drain / in place, time per step: **"
        f"{steps['drain']['step_s'] / steps['in_place']['step_s']:.2f}x**.", "",
        "Drain waits out the longest turn in flight; in place does not (compare each "
        "in_place row with its last column). The dev server generates a batch in lockstep "
        "to its longest request, so under drain the long turns also run slower (their "
        "batch keeps its finished rows) than after an update in place, which resumes them "
        "as a batch of their own: the drain rows measure this server, the in-place rows "
        "the farm's update (pause, load, resume; the check follows, the call's time). The "
        "same lockstep batching favours in place in the DAPO run beyond the sync itself: "
        "an update in place ends the batch being generated and its turns resume together "
        "with the requests queued behind it.", "",
    ]
    report(lines, args.record)


def _ok(engine: str) -> bool:
    try:
        with urllib.request.urlopen(engine + "/health", timeout=2):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
