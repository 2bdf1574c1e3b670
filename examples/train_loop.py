"""A trainer's loop around the farm, framework-neutral: the template to copy into yours.

Against a running farm with a model backend, e.g. the CPU dev model:

    .venv/bin/prorl-farm tiny-model /tmp/tiny
    make up UP_ARGS="--model /tmp/tiny"                # in another terminal
    .venv/bin/python examples/train_loop.py --url http://127.0.0.1:8000 --steps 3

Each step:
1. ``DynamicSampler.next_batch(version)``: ``--groups`` prompt groups of ``--n`` rollouts
   whose rewards vary (DAPO's filter), replenished while the step waits; finished and
   in-flight groups within the staleness bound carry over to the next step.
2. An adapter turns the groups into your framework's layout (here VeRL's, ``to_verl``):
   token IDs, loss mask, the rollout's logprobs, rewards, group ids. (NeMo RL takes the
   farm's rollouts through NeMo Gym: the farm is a Gym agent server, docs/trainers.md.)
   (A model may answer every prompt of a group alike, e.g. a random one on ``--task
   arith``: a step whose budget of groups finds none that qualifies trains on nothing and
   keeps the version.)
3. ``train_step``: your framework's update. Here it checks the layout and returns the
   weights to serve next: the backend's own, unchanged, so this loop shows the protocol
   without learning anything (``examples/grpo_cpu.py`` learns for real).
4. Weight sync, one farm call (``FarmClient.sync_weights``): the farm drains the backend
   (no new job pins it), waits until nothing is in flight on it, loads the new weights the
   engine's way (vLLM's ``reload_weights``, SGLang's ``/update_weights_from_disk``; the dev
   model server speaks both), resets its prefix cache, checks that it now computes what the
   checkpoint computes, and resumes it with policy version + 1. Every trajectory of the
   next step then carries that version.

Prints a JSON line per step (the sampler's stats, the layout's shapes) and, at the end,
a summary line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prorl_farm.trainer import FarmClient  # noqa: E402
from prorl_farm.trainer.adapters import to_verl  # noqa: E402
from prorl_farm.trainer.dapo import DynamicSampler  # noqa: E402

LETTERS = "etaoinsrhl"


def prompts(task: str, seed: int, operands: int = 10):
    """Instances for the task; swap in your dataset's.

    ``letter`` (the ``chat`` handler): "write a word with the letter X", reward 1 when the
    reply contains X. Even a random untrained model's replies sometimes do and sometimes
    do not, so its groups vary and every step trains. ``arith`` (single-digit sums) needs a
    model that can add a little: a random one answers every prompt of a group wrong."""
    rng = random.Random(seed)
    while True:
        if task == "arith":
            yield {"a": rng.randrange(operands), "b": rng.randrange(operands)}
        else:
            letter = rng.choice(LETTERS)
            yield {"messages": [{"role": "user",
                                 "content": f"Write a word with the letter {letter}."}],
                   "answer": letter}


def train_step(layout: dict, backend: dict) -> str:
    """Stand-in for the framework's update: check the batch, return the weights to load."""
    b = layout["batch"]
    assert b["response_mask"].shape == b["rollout_log_probs"].shape == b["responses"].shape
    assert len(layout["non_tensor_batch"]["uid"]) == b["input_ids"].shape[0]
    return backend["tokenizer"]  # the dev server's model directory: its weights, unchanged


def sync_weights(farm: FarmClient, backend: dict, weights: str, version: int) -> None:
    """Drain, wait, load, reset, check, resume: the farm does it all (409 if the check
    fails, the backend then kept out of service)."""
    farm.sync_weights(weights, version, backend_id=backend["id"], drain_timeout_s=300)


def shapes(layout: dict) -> dict:
    return {k: list(v.shape) for k, v in layout["batch"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--token", default=None, help="the API token (default PRORL_API_TOKEN)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--task", choices=["letter", "arith"], default="letter")
    ap.add_argument("--operands", type=int, default=10, help="a and b drawn from 0..N-1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    farm = FarmClient(args.url, token=args.token)
    backends = [b for b in farm.backends() if b["healthy"]]
    if len(backends) != 1:
        raise SystemExit(f"this example syncs one backend; the farm has {len(backends)} "
                         "healthy (start it with `make up UP_ARGS=\"--model DIR\"`)")
    backend = backends[0]
    version = int(backend["policy_version"] or 0)
    handler = "arith" if args.task == "arith" else "chat"
    sampler = DynamicSampler(farm, prompts(args.task, args.seed, args.operands),
                             handler=handler, n=args.n, batch_groups=args.groups, carry=True,
                             staleness=1, sampling={"temperature": 1.0, "max_tokens": 8},
                             rollout_deadline_s=300, max_groups_per_step=16 * args.groups)
    stale = 0
    try:
        for step in range(args.steps):
            batch = sampler.next_batch(policy_version=version)
            row = {"step": step, "policy_version": version, "groups": len(batch),
                   "stats": asdict(batch.stats)}
            if not batch.groups:  # nothing qualified within the step's budget: no update
                print(json.dumps(row), flush=True)
                continue
            stale += sum(1 for g in batch if g.policy_version < version - sampler.staleness)
            layout = to_verl(batch.groups)
            weights = train_step(layout, backend)
            sync_weights(farm, backend, weights, version + 1)
            print(json.dumps(dict(row, layout=shapes(layout))), flush=True)
            version += 1
    finally:
        sampler.close()  # cancels whatever is still running
    print(json.dumps({"steps": args.steps, "final_version": version,
                      "groups_staler_than_bound": stale}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
