"""Engines benchmark: the farm on real vLLM (CPU build, float32) against the farm on its own
dev model server, same machine, same tiny model, same jobs.

  python bench/engines.py [--jobs 64] [--record]

For each engine, `prorl-farm up --model DIR --engine E` runs the whole farm; then
- rollouts: ``--jobs`` two-turn `chat` jobs (32 tokens a turn, temperature 1), submitted at
  once; wall time to the last one, rollouts and sampled tokens a second;
- weight sync: `FarmClient.sync_weights` calls (drain, load the engine's way, reset its
  prefix cache, check the served logprobs of a probe, resume), each to a new checkpoint:
  three with the farm's own probe (scored from the checkpoint in a child process), three
  with a probe the trainer passes; the call's wall time, and the engine's load alone.
The dev server is the baseline (ratio 1).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, machine, report  # noqa: E402

from prorl_farm.dev.engines import choose  # noqa: E402
from prorl_farm.llm.weights import score  # noqa: E402
from prorl_farm.supervisor import free_port  # noqa: E402
from prorl_farm.trainer import FarmClient  # noqa: E402


def _probe(path: Path) -> dict:
    """What a trainer passes: token ids and its own model's logprob of each after the first."""
    probe = score(str(path), list(range(10, 42)))
    return {"token_ids": probe.token_ids, "logprobs": probe.logprobs}


def _perturbed(model_dir: Path, out: Path, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    m.save_pretrained(str(out))
    return out


class Farm:
    def __init__(self, model: Path, engine: str, home: Path):
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
        env.update(PRORL_HOME=str(home), PRORL_API_PORT=str(self.port),
                   PRORL_FLOWER_PORT=str(free_port()), PRORL_LOG_LEVEL="WARNING",
                   PRORL_TASK_EVENTS="0", PRORL_SANDBOX_DIR=f"/tmp/prs-bench-{self.port}")
        home.mkdir(parents=True, exist_ok=True)
        self.log = open(home / "up.out", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "prorl_farm.cli", "up", "--model",
                                      str(model), "--engine", engine], env=env, cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.client = FarmClient(f"http://127.0.0.1:{self.port}", timeout_s=600)
        end = time.monotonic() + 600
        while not (self.client.ready() and self.client.backends()):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise SystemExit(f"the farm did not come up: {home}/up.out")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)
        self.log.close()


def measure(model: Path, engine: str, jobs: int, work: Path) -> dict:
    farm = Farm(model, engine, work / f"farm-{engine}")
    try:
        c = farm.client
        [backend] = c.backends()
        instances = [{"messages": [{"role": "user", "content": f"Count to {i}."}],
                      "observations": ["Go on."], "continue_on_length": True}
                     for i in range(jobs)]
        sampling = {"temperature": 1.0, "max_tokens": 32, "ignore_eos": True}
        c.submit("chat", instances[:4], sampling=sampling)  # warm-up
        time.sleep(2)
        t0 = time.monotonic()
        sub = c.submit("chat", instances, sampling=sampling)
        done = list(c.iter_results(sub["batch_id"], expected=jobs, progress=False))
        wall = time.monotonic() - t0
        ok = [j for j in done if j["state"] == "done"]
        tokens = sum(sum(j["result"]["response_mask"]) for j in ok)
        syncs, probed, loads = [], [], []
        for step in range(1, 7):
            path = _perturbed(model, work / f"{engine}-step{step}", step)
            probe = _probe(path) if step > 3 else None
            t0 = time.monotonic()
            out = c.sync_weights(str(path), step, backend_id=backend["id"], probe=probe)
            (probed if probe else syncs).append(time.monotonic() - t0)
            loads.append(out["weights"]["load_s"])
            assert out["weights"]["error"] is None and out["weights"]["max_error"] < 1e-4, out
        return {"ok": len(ok), "wall": wall, "rollouts_s": len(ok) / wall,
                "tokens_s": tokens / wall, "sync_s": statistics.median(syncs),
                "probed_s": statistics.median(probed),
                "load_s": statistics.median(loads)}
    finally:
        farm.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    engine, _, why = choose("vllm")
    if engine != "vllm":
        raise SystemExit(f"vLLM cannot run here: {why}")
    from prorl_farm.dev.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        model = build_tiny_model(work / "tiny")
        rows = {e: measure(model, e, args.jobs, work) for e in ("dev", "vllm")}
    base = rows["dev"]
    lines = [f"\n### engines — {datetime.date.today()} — {machine()}\n",
             f"{args.jobs} two-turn `chat` jobs (32 tokens a turn, ignore_eos), submitted at "
             "once, through `prorl-farm up --model DIR --engine E` (tiny untied Qwen2, hidden "
             "128, float32); then 6 checked weight syncs (3 with the farm's probe, 3 with the "
             "trainer's).\n",
             "| engine | done | wall (s) | rollouts/s | sampled tokens/s | x dev | sync, farm's "
             "probe (s) | sync, trainer's probe (s) | engine load (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e, r in rows.items():
        lines.append(f"| {e} | {r['ok']}/{args.jobs} | {r['wall']:.2f} | {r['rollouts_s']:.1f} "
                     f"| {r['tokens_s']:.0f} | {r['tokens_s'] / base['tokens_s']:.2f} "
                     f"| {r['sync_s']:.2f} | {r['probed_s']:.2f} | {r['load_s']:.3f} |")
    lines.append("\nA sync call is drain + wait for in-flight 0 + the engine's load + its cache "
                 "reset + the check + resume. Scoring the farm's probe from the checkpoint "
                 "costs a child process that imports torch and transformers (about 4 s here, "
                 "the model's forward pass a few ms); a trainer's own probe skips it.")
    report(lines, args.record)


if __name__ == "__main__":
    main()
