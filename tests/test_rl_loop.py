"""examples/grpo_cpu.py as it ships: a trainer updates a tiny policy from farm rollouts
only (`prorl-farm up --dev-model`: real Redis, pools, model server), syncing weights through
drain / load / resume each step, and its reward rises.

Checks, on every step: the recorded logprobs match a teacher-forced recomputation by the
trainer's current weights (so the server sampled with exactly the weights the trainer last
synced), every turn carries the step's policy version; over the run, the mean reward of
the last 10 steps exceeds that of the first 10 by at least 0.2; at the end nothing is left
running and no backend slot is held."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.farm import ROOT

pytestmark = pytest.mark.slow


def _example():
    spec = importlib.util.spec_from_file_location("grpo_cpu", ROOT / "examples" / "grpo_cpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_cpu"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_grpo_through_the_farm_raises_the_reward(tmp_path):
    grpo = _example()
    cfg = grpo.Config()  # the shipped defaults: what `make grpo` runs
    assert cfg.steps >= 20
    lines: list[str] = []
    result = grpo.train(cfg, tmp_path / "run", log=lines.append)
    history = result["history"]
    assert [r["step"] for r in history] == list(range(cfg.steps))
    # Sampled by the server with the weights the trainer synced after the previous update.
    assert all(r["logprob_drift"] <= 1e-3 for r in history), history
    assert result["version_violations"] == []
    assert all(1 <= r["accepted"] <= cfg.groups for r in history)
    assert all(r["rollouts"] >= r["accepted"] * cfg.n for r in history)
    rewards = [r["reward"] for r in history]
    assert all(0.0 <= x <= 1.0 for x in rewards)
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.2, (first, last, rewards)
    assert result["unfinished_batches"] == [] and result["backend_in_flight"] == 0
    saved = json.loads((tmp_path / "run" / "history.json").read_text())
    assert saved["history"] == history
    assert (tmp_path / "run" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("mean reward, first 10 steps" in line for line in lines)
