"""Run by tests/test_verl.py with VeRL's environment: the farm's agent loop driven the way
VeRL drives agent loops, by its own ``AgentLoopWorker`` (built from VeRL's PPO trainer
config with the loop selected through ``agent_loop_config_path``, as a user would), on a
batch of chat samples: ``generate_sequences`` runs ``FarmAgentLoop.run`` per sample and
VeRL's post-processing pads and stacks what it returns. A sample whose farm job fails
surfaces as an error, and a cancelled sample cancels its farm job.

    .venv-verl/bin/python tests/verl_agent_loop_check.py FARM_URL MODEL_DIR WORK_DIR

Prints one JSON line of figures; exits non-zero on any mismatch.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import numpy as np
import verl
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.protocol import DataProto

from prorl_farm.trainer import FarmClient
from prorl_farm.trainer.verl_loop import FarmRolloutFailed

STOPS = list(range(300, 500))
PROMPT_LEN, RESPONSE_LEN = 64, 96


def trainer_config(model_dir: str, work: Path, url: str):
    config = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/"
                            "_generated_ppo_trainer.yaml")
    loops = work / "agent_loops.yaml"
    loops.write_text(f"- name: prorl_farm\n  _target_: prorl_farm.trainer.verl_loop."
                     f"FarmAgentLoop\n  farm_url: {url}\n  handler: chat\n  max_tokens: 12\n")
    config.actor_rollout_ref.model.path = model_dir
    config.data.max_prompt_length = PROMPT_LEN
    config.data.max_response_length = RESPONSE_LEN
    rollout = config.actor_rollout_ref.rollout
    rollout.name = "vllm"  # the engine VeRL would start; the farm serves this loop
    rollout.temperature = 0.7
    rollout.agent.agent_loop_config_path = str(loops)
    rollout.agent.default_agent_loop = "prorl_farm"
    return config


def samples(n: int, extra: list[dict]) -> DataProto:
    prompts = np.empty(n, dtype=object)
    prompts[:] = [[{"role": "user", "content": f"def g{i}(x):"}] for i in range(n)]
    extra_info = np.empty(n, dtype=object)
    extra_info[:] = extra
    return DataProto.from_dict(non_tensors={
        "raw_prompt": prompts, "extra_info": extra_info,
        "agent_name": np.array(["prorl_farm"] * n, dtype=object),
        "index": np.arange(n)}, meta_info={"global_steps": 1})


def chat(i: int, **more) -> dict:
    return {"prorl_instance": {
        "messages": [{"role": "user", "content": f"def g{i}(x):"}],
        "observations": ["Traceback: NameError", "ok, again"], "observation_role": "tool",
        "continue_on_length": True, **more}}


async def main() -> None:
    url, model_dir, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    config = trainer_config(model_dir, work, url)
    worker = AgentLoopWorker(config, llm_client=None)
    farm = FarmClient(url)

    # The stop tokens make some turns end early: multi-turn episodes of varied lengths.
    os.environ.setdefault("PRORL_URL", url)
    n = 4
    out = await worker.generate_sequences(samples(n, [chat(i) for i in range(n)]))
    t = out.batch
    assert t["prompts"].shape == (n, PROMPT_LEN) and t["responses"].shape == (n, RESPONSE_LEN)
    turns = out.non_tensor_batch["__num_turns__"].tolist()
    ids = out.non_tensor_batch["prorl_job_id"].tolist()
    for row, job_id in enumerate(ids):
        job = farm.job(job_id)
        res = job["result"]
        resp = [int(x) for x in res["response_ids"]][:RESPONSE_LEN]
        k = len(resp)
        assert t["responses"][row, :k].tolist() == resp, row
        assert t["response_mask"][row, :k].tolist() == [int(x) for x in res["response_mask"]][:k]
        assert t["response_mask"][row, k:].sum() == 0
        got = t["rollout_log_probs"][row, :k]
        want = np.asarray(res["response_logprobs"][:k], dtype=np.float32)
        assert np.array_equal(got.numpy(), want), row
        p = [int(x) for x in res["prompt_ids"]][-PROMPT_LEN:]
        assert t["prompts"][row, PROMPT_LEN - len(p):].tolist() == p  # left-padded
        # The farm's reward, where VeRL's trainer reads it: the last response token.
        assert float(t["rm_scores"][row].sum()) == job["reward"]
        assert float(t["rm_scores"][row, max(k - 1, 0)]) == job["reward"]
    assert max(turns) > 2, turns

    # A failed job is an error of its sample (VeRL marks the group failed), never a zero.
    failed = None
    try:
        await worker.generate_sequences(samples(1, [{"prorl_handler": "synthetic",
                                                     "prorl_instance": {"fail_stage": "run"}}]))
    except FarmRolloutFailed as e:
        failed = e.kind
    assert failed == "run_error", failed

    # A cancelled sample cancels its farm job.
    worker2 = AgentLoopWorker(config, llm_client=None)
    task = asyncio.create_task(worker2.generate_sequences(samples(1, [{
        "prorl_handler": "synthetic", "prorl_instance": {"run_s": 60}}])))
    await asyncio.sleep(2.0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await asyncio.sleep(1.0)
    mine = [b for b in farm.batches(limit=50) if b["handler"] == "synthetic"
            and b["counts"].get("cancelled")]
    assert mine, [(b["batch_id"], b["counts"]) for b in farm.batches(limit=50)]
    farm.http.close()
    print(json.dumps({"rows": n, "num_turns": turns, "failed_kind": failed,
                      "cancelled": len(mine)}))


if __name__ == "__main__":
    asyncio.run(main())
