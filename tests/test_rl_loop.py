"""examples/grpo_cpu.py, short: a trainer updates a tiny policy from farm rollouts only
(`prorl-farm up --dev-model`: real Redis, pools, model server), syncing weights through
drain / load / resume each step. Checks the mechanics on every step: the recorded logprobs
match a teacher-forced recomputation by the trainer's current weights (so the server
sampled with exactly the weights the trainer last synced), every turn carries the step's
policy version, and at the end nothing is left running and no backend slot is held."""

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


def test_grpo_loop_through_the_farm(tmp_path):
    grpo = _example()
    lines: list[str] = []
    result = grpo.train(grpo.Config(steps=5, groups=8, n=4), tmp_path / "run",
                        log=lines.append)
    history = result["history"]
    assert [r["step"] for r in history] == [0, 1, 2, 3, 4]
    # Sampled by the server with the weights the trainer synced after the previous update.
    assert all(r["logprob_drift"] <= 1e-3 for r in history), history
    assert result["version_violations"] == []
    assert all(r["accepted"] == 8 and r["rollouts"] >= 32 for r in history)
    assert all(r["reward"] is not None and 0.0 <= r["reward"] <= 1.0 for r in history)
    assert result["unfinished_batches"] == [] and result["backend_in_flight"] == 0
    saved = json.loads((tmp_path / "run" / "history.json").read_text())
    assert saved["history"] == history
    assert (tmp_path / "run" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("mean reward, first 10 steps" in line for line in lines)
