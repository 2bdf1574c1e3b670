"""GRPO on a CPU with every rollout from the farm: a tiny model learns single-digit addition.

What it does, end to end:
1. Builds a character-level tokenizer and a tiny Qwen2 (about 126k parameters) offline.
2. A short supervised warm start on correct sums (without it RL tends to collapse onto the
   most common sum).
3. Starts a farm with `prorl-farm up --model DIR --engine ENGINE` (a private Redis, the API,
   the three pools, the model served on the CPU by the farm's dev server or, with
   ``--engine vllm``, by vLLM's CPU build, registered as a backend at policy version 0).
4. Each step asks the dynamic sampler (DAPO: groups whose rewards all agree are dropped and
   replaced while the step waits) for ``--groups`` groups of ``--n`` rollouts of the
   ``arith`` task, turns them into a VeRL-layout batch with the adapter, checks the
   recorded logprobs against a teacher-forced recomputation, and takes PPO-clip steps with
   the recorded logprobs as the old policy (group-normalised advantages, clip-higher).
5. After each update: save the weights (safetensors) and ask the farm to sync them
   (``FarmClient.sync_weights``: drain, wait until nothing is in flight, load them the
   engine's way, reset its prefix cache, check the served logprobs of a probe the trainer
   computes with its own model, resume with the next policy version). Every trajectory of
   step k must carry version k on every turn, and its recorded logprobs must match the
   trainer's teacher-forced ones within ``--max-drift`` (the check at every step).
6. With ``--staleness K`` (K > 0), asynchronously: the sync is in place (generation
   pauses, the turns in flight go on under the new weights from the tokens they have),
   groups still running when a step has its groups carry into the next steps, and every
   token must come from a version at most K behind; the drift check covers the tokens the
   current weights sampled.

Prints a row per step, writes ``history.json`` and the reward curve ``reward.png``.

    .venv/bin/python examples/grpo_cpu.py [--steps 40] [--out grpo-run]      # or: make grpo
    make grpo GRPO_ARGS="--engine vllm --steps 5"                # rollouts from real vLLM
    make grpo GRPO_ARGS="--staleness 1"              # in-place updates and carry-over
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from prorl_farm.handlers.arith import prompt_messages  # noqa: E402
from prorl_farm.supervisor import free_port  # noqa: E402
from prorl_farm.trainer import FarmClient  # noqa: E402
from prorl_farm.trainer.adapters import to_verl  # noqa: E402
from prorl_farm.trainer.dapo import DynamicSampler  # noqa: E402


@dataclass
class Config:
    steps: int = 40
    groups: int = 16  # prompt groups per training batch
    n: int = 8  # rollouts per group
    # With 8 passes per batch, 1e-3 sometimes locked wrong answers in (the reward stalled
    # at its start); 5e-4 rose on every seed tried.
    lr: float = 5e-4
    # The learning rate rises linearly to lr over these steps: a policy that learnt fastest
    # at the start also locked wrong answers in soonest.
    warmup_steps: int = 10
    warm_steps: int = 40
    warm_lr: float = 3e-3
    clip_low: float = 0.2
    clip_high: float = 0.28  # DAPO's clip-higher
    minibatches: int = 4
    # Passes over each batch (PPO-clip keeps them near the old policy). Sampling is most
    # of a step's time, so more passes are cheap; 4 learnt about 1.5x as fast as 2, 8
    # faster still.
    epochs: int = 8
    max_tokens: int = 4
    # Groups in flight beyond what the observed acceptance rate says a step needs, and at
    # most this many times the step's groups: what is still running when the step has its
    # groups is cancelled (every rollout must come from the current weights), so more is
    # waste.
    overprovision: float = 1.25
    max_in_flight: float = 4.0
    # Seconds a step samples at most (0: until it has its groups): it then trains on the
    # groups that qualified by then (at least one). As the policy sharpens, more groups
    # come back all right or all wrong and are dropped; this bounds what a step spends
    # looking for the rest, at the cost of smaller batches.
    step_sample_s: float = 0.0
    # Groups a step submits at most (0: no bound), then it trains on those that qualified
    # among them: the same bound as step_sample_s, counted in groups (the same on any
    # machine) rather than seconds.
    max_groups_per_step: int = 32
    # Operands are drawn from 0..operands-1 (10: all 100 single-digit sums). The tiny model
    # learns each sum on its own, so fewer prompts are learnt in fewer steps: with 4 (16
    # sums) the reward rises from about 0.2 to 0.8 in 40 steps.
    operands: int = 4
    seed: int = 0
    threads: int = 1
    # What serves the rollouts: the farm's dev server, or vLLM's CPU build (make vllm).
    engine: str = "dev"
    # The logprob check at every step: the largest difference between a recorded logprob
    # and the trainer's teacher-forced one, before the update (float32 on both sides), over
    # the tokens the current weights sampled.
    max_drift: float = 1e-3
    # 0: strictly on-policy (each sync drains the backend first; what is in flight when a
    # step has its groups is cancelled). k > 0: asynchronous: weights are updated in place
    # (the turns in flight go on under the new weights), groups in flight are carried into
    # the next steps, and a rollout trains while its oldest token is at most k versions
    # behind (PPO's ratio is then against the policy that sampled each token).
    staleness: int = 0


# -- the model --------------------------------------------------------------------------


def build(out: Path, seed: int, small: bool = True):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from prorl_farm.dev.tiny import build_tiny_model

    hf_logging.disable_progress_bar()
    # vLLM's CPU attention needs heads of 32 or more: the small model (heads of 16) learns
    # fastest, so it is the default where the dev server serves it.
    path = build_tiny_model(out / "init", seed=seed, chars=True, small=small)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return path, tok, model


def prompt_ids(tok, a: int, b: int) -> list[int]:
    ids = tok.apply_chat_template(prompt_messages(a, b), add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def warm_start(model, tok, cfg: Config, rng: random.Random) -> None:
    """Supervised steps on correct sums: cross-entropy on the answer and its end token."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    opt = torch.optim.Adam(model.parameters(), lr=cfg.warm_lr)
    model.train()
    for _ in range(cfg.warm_steps):
        rows, labels = [], []
        for _ in range(32):
            a, b = rng.randrange(cfg.operands), rng.randrange(cfg.operands)
            p = prompt_ids(tok, a, b)
            answer = tok.encode(str(a + b), add_special_tokens=False) + [end]
            rows.append(p + answer)
            labels.append([-100] * len(p) + answer)
        width = max(map(len, rows))
        ids = torch.tensor([r + [end] * (width - len(r)) for r in rows])
        lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        loss = model(input_ids=ids, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@torch.no_grad()
def greedy_accuracy(model, tok, operands: int = 10) -> float:
    """Share of the prompts answered exactly (greedy, then the end token)."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    pairs = [(a, b) for a in range(operands) for b in range(operands)]
    ids = torch.tensor([prompt_ids(tok, a, b) for a, b in pairs])
    for _ in range(3):
        nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    tail = ids[:, -3:].tolist()
    good = 0
    for (a, b), t in zip(pairs, tail):
        want = tok.encode(str(a + b), add_special_tokens=False) + [end]
        good += t[:len(want)] == want
    return good / len(pairs)


def response_logprobs(model, batch: dict) -> torch.Tensor:
    """Teacher-forced logprob of every response token: (batch, response length)."""
    p = batch["prompts"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"])
    lp = torch.log_softmax(out.logits[:, p - 1:-1].float(), -1)
    return lp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def advantages(batch: dict, uids) -> torch.Tensor:
    """GRPO as VeRL computes it (``compute_grpo_outcome_advantage``): each rollout's reward
    against its group's mean, in units of its group's unbiased std (+1e-6); a group of one
    keeps its reward (mean 0, std 1)."""
    rewards = batch["token_level_scores"].sum(-1)
    adv = torch.zeros_like(rewards)
    for uid in set(uids):
        idx = torch.tensor([i for i, u in enumerate(uids) if u == uid])
        r = rewards[idx]
        if len(idx) == 1:
            adv[idx] = r
        else:
            adv[idx] = (r - r.mean()) / (r.std() + 1e-6)
    return adv


def lr_at(cfg: Config, step: int) -> float:
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr


def update(model, opt, batch: dict, uids, cfg: Config, rng: random.Random,
           version: int) -> dict:
    """PPO-clip with the farm's recorded logprobs as the old policy (the behaviour policy's,
    token by token); token-level mean. The drift is checked over the tokens that the
    current weights (``version``) sampled: older ones came from weights no longer here."""
    mask = batch["response_mask"].float()
    old = batch["rollout_log_probs"].float()
    current = (batch["rollout_versions"] == version).float() * mask
    with torch.no_grad():
        recomputed = response_logprobs(model, batch)
    drift = float(((recomputed - old).abs() * current).max()) if current.any() else 0.0
    adv = advantages(batch, list(uids)).unsqueeze(-1)
    size = max(1, -(-len(uids) // cfg.minibatches))
    model.train()
    losses = []
    order = []
    for _ in range(cfg.epochs):
        shuffled = list(range(len(uids)))
        rng.shuffle(shuffled)
        order += [shuffled[i:i + size] for i in range(0, len(shuffled), size)]
    for chunk in order:
        idx = torch.tensor(chunk)
        mb = {k: v[idx] for k, v in batch.items()}
        new = response_logprobs(model, mb)
        ratio = torch.exp(new - old[idx])
        surrogate = torch.minimum(ratio * adv[idx],
                                  ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv[idx])
        m = mask[idx]
        loss = -(surrogate * m).sum() / m.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return {"logprob_drift": drift, "loss": sum(losses) / len(losses)}


# -- the farm ---------------------------------------------------------------------------


class LocalFarm:
    """`prorl-farm up --model DIR --engine ENGINE` in the background, stopped (SIGTERM) on
    exit."""

    def __init__(self, model_dir: Path, home: Path, engine: str = "dev"):
        self.api_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
        # Short (a sandbox's socket path must fit 107 bytes); removed with the farm.
        self.sandbox_dir = Path(f"/tmp/prs-grpo-{self.api_port}")
        env.update(PRORL_HOME=str(home), PRORL_API_PORT=str(self.api_port),
                   PRORL_FLOWER_PORT=str(free_port()), PRORL_GYM_PORT="0",
                   PRORL_LOG_LEVEL="WARNING",
                   PRORL_SANDBOX_DIR=str(self.sandbox_dir),
                   PRORL_TASK_EVENTS="0", PYTHONPATH=str(ROOT))
        home.mkdir(parents=True, exist_ok=True)
        self.log = open(home / "up.out", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prorl_farm.cli", "up", "--model", str(model_dir),
             "--engine", engine],
            env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.client = FarmClient(self.url)
        end = time.monotonic() + (600 if engine == "vllm" else 180)
        while not (self.client.ready() and self.client.backends()):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise SystemExit(f"the farm did not come up; see {home}/up.out and logs/")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.sandbox_dir, ignore_errors=True)


def probe(model, tok) -> dict:
    """Token ids and the logprob the trainer's model gives each after the first: what the
    farm checks the backend against before it serves the new weights."""
    ids = prompt_ids(tok, 3, 4) + tok.encode("7", add_special_tokens=False)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    return {"token_ids": ids, "logprobs": [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]}


def sync_weights(farm: FarmClient, backend: dict, model, tok, path: Path, version: int,
                 mode: str = "drain") -> dict:
    """Save, then one farm call: drain, wait for nothing in flight (``mode="in_place"``:
    pause, the turns in flight kept), load the engine's way, check the probe, resume at
    ``version``."""
    model.save_pretrained(str(path))
    return farm.sync_weights(str(path), version, backend_id=backend["id"],
                             probe=probe(model, tok), tolerance=1e-3, drain_timeout_s=120,
                             mode=mode)


def prompts(rng: random.Random, operands: int = 10):
    while True:
        yield {"a": rng.randrange(operands), "b": rng.randrange(operands)}


# -- the loop ---------------------------------------------------------------------------


def train(cfg: Config, out: Path, log=print) -> dict:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    init_dir, tok, model = build(out, cfg.seed, small=cfg.engine != "vllm")
    t0 = time.monotonic()
    warm_start(model, tok, cfg, rng)
    acc0 = greedy_accuracy(model, tok, cfg.operands)
    log(f"warm start: {cfg.warm_steps} steps in {time.monotonic() - t0:.1f} s, greedy "
        f"accuracy {acc0:.2f}")
    model.save_pretrained(str(init_dir))  # the farm's model server starts from these
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    farm = LocalFarm(init_dir, out / "farm", cfg.engine)
    history: list[dict] = []
    violations: list[str] = []
    try:
        client = farm.client
        [backend] = client.backends()
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        sampler = DynamicSampler(client, prompts(rng, cfg.operands), "arith", n=cfg.n,
                                 batch_groups=cfg.groups, carry=cfg.staleness > 0,
                                 staleness=cfg.staleness,
                                 sampling={"temperature": 1.0, "max_tokens": cfg.max_tokens},
                                 rollout_deadline_s=120, overprovision=cfg.overprovision,
                                 max_groups_in_flight=int(cfg.max_in_flight * cfg.groups),
                                 max_groups_per_step=cfg.max_groups_per_step or None)
        log(f"{'step':>4} {'reward':>6} {'acc':>4} {'filt':>4} {'sample_s':>8} "
            f"{'update_s':>8} {'sync_s':>6} {'|dlogp|':>8}")
        with sampler:
            for step in range(cfg.steps):
                t0 = time.monotonic()
                batch = sampler.next_batch(policy_version=step,
                                           timeout_s=cfg.step_sample_s or 300)
                while not len(batch):  # nothing qualified in time: sample on
                    batch = sampler.next_batch(policy_version=step, timeout_s=300)
                sample_s = time.monotonic() - t0
                verl = to_verl(batch, pad_token_id=pad, as_torch=True)
                # Every sampled token from a version within the bound (exactly this step's
                # when strictly on-policy).
                versions = verl["batch"]["rollout_versions"]
                sampled = versions[versions >= 0]
                for v in sorted(set(sampled.tolist())):
                    if not step - cfg.staleness <= v <= step:
                        violations.append(f"step {step}: tokens sampled at version {v}")
                t1 = time.monotonic()
                for group in opt.param_groups:
                    group["lr"] = lr_at(cfg, step)
                upd = update(model, opt, verl["batch"], verl["non_tensor_batch"]["uid"], cfg,
                             rng, step)
                update_s = time.monotonic() - t1
                t2 = time.monotonic()
                if upd["logprob_drift"] > cfg.max_drift:
                    violations.append(f"step {step}: recorded logprobs differ from the "
                                      f"trainer's by {upd['logprob_drift']:.2e}")
                sync_weights(client, backend, model, tok, out / "weights", step + 1,
                             "in_place" if cfg.staleness else "drain")
                sync_s = time.monotonic() - t2
                s = batch.stats
                row = {"step": step, "reward": s.reward_mean, "accepted": s.accepted,
                       "filtered": s.filtered_zero_variance + s.filtered_failed,
                       "rollouts": s.rollouts_judged, "sample_s": round(sample_s, 3),
                       "update_s": round(update_s, 3), "sync_s": round(sync_s, 3),
                       "logprob_drift": upd["logprob_drift"], "loss": upd["loss"],
                       "policy_version": step, "staleness_mean": s.staleness_mean,
                       "staleness_max": s.staleness_max,
                       "token_staleness_mean": s.token_staleness_mean,
                       "carried_in": s.carried_in}
                history.append(row)
                log(f"{step:>4} {row['reward']:>6.3f} {row['accepted']:>4} "
                    f"{row['filtered']:>4} {sample_s:>8.2f} {update_s:>8.2f} {sync_s:>6.2f} "
                    f"{row['logprob_drift']:>8.1e}")
        acc1 = greedy_accuracy(model, tok, cfg.operands)
        # Nothing left behind: every job of every group terminal, no backend slot held.
        unfinished = [b for b in sampler.batch_ids if not client.batch(b)["complete"]]
        deadline = time.monotonic() + 30
        while unfinished and time.monotonic() < deadline:
            time.sleep(0.2)
            unfinished = [b for b in unfinished if not client.batch(b)["complete"]]
        in_flight = client.backend(backend["id"])["in_flight"]
    finally:
        farm.stop()
    result = {"config": asdict(cfg), "history": history, "greedy_accuracy": [acc0, acc1],
              "version_violations": violations, "unfinished_batches": unfinished,
              "backend_in_flight": in_flight}
    (out / "history.json").write_text(json.dumps(result, indent=1))
    plot(out / "reward.png", [r["reward"] for r in history])
    k = max(1, min(10, len(history) // 4))  # 10 steps of 40; 3 of a 12-step run
    first = sum(r["reward"] for r in history[:k]) / max(1, len(history[:k]))
    last = sum(r["reward"] for r in history[-k:]) / max(1, len(history[-k:]))
    log(f"mean reward, first {k} steps {first:.3f} -> last {k} {last:.3f}; greedy accuracy "
        f"{acc0:.2f} -> {acc1:.2f}; curve: {out / 'reward.png'}")
    return result


# -- a PNG without plotting libraries -----------------------------------------------------


def plot(path: Path, ys: list[float], width: int = 640, height: int = 320) -> None:
    """The reward per step (blue) and its 10-step moving average (red) on [0, 1]."""
    img = bytearray(b"\xff" * (width * height * 3))
    left, right, top, bottom = 40, width - 10, 10, height - 30

    def put(x: int, y: int, rgb) -> None:
        if 0 <= x < width and 0 <= y < height:
            i = (y * width + x) * 3
            img[i:i + 3] = bytes(rgb)

    def line(x0, y0, x1, y1, rgb, thick=1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(steps + 1):
            x = round(x0 + (x1 - x0) * k / steps)
            y = round(y0 + (y1 - y0) * k / steps)
            for d in range(thick):
                put(x, y + d, rgb)

    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):  # grid on reward 0, .25, ... 1
        y = round(bottom - frac * (bottom - top))
        line(left, y, right, y, (220, 220, 220))
    line(left, top, left, bottom, (0, 0, 0))
    line(left, bottom, right, bottom, (0, 0, 0))
    if ys:
        def xy(i, v):
            x = left + (right - left) * i / max(1, len(ys) - 1)
            return round(x), round(bottom - max(0.0, min(1.0, v)) * (bottom - top))

        avg = [sum(ys[max(0, i - 9):i + 1]) / len(ys[max(0, i - 9):i + 1])
               for i in range(len(ys))]
        for series, rgb, thick in ((ys, (70, 110, 220), 1), (avg, (220, 50, 50), 2)):
            pts = [xy(i, v) for i, v in enumerate(series)]
            for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
                line(x0, y0, x1, y1, rgb, thick)
    raw = b"".join(b"\x00" + bytes(img[y * width * 3:(y + 1) * width * 3])
                   for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    path.write_bytes(b"\x89PNG\r\n\x1a\n"
                     + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Config()
    for name, value in asdict(d).items():
        if name == "engine":
            continue
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    ap.add_argument("--engine", choices=["dev", "vllm"], default=d.engine)
    ap.add_argument("--out", default="grpo-run", help="where weights, logs, history.json "
                    "and reward.png go")
    args = vars(ap.parse_args(argv))
    # SIGTERM unwinds like Ctrl-C, so the farm this started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.pop("out")).resolve()
    result = train(Config(**args), out)
    return 1 if result["version_violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
