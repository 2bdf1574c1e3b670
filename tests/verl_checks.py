"""Run by tests/test_verl.py with VeRL's own environment (.venv-verl): the farm's results,
fetched with FarmClient and laid out by ``to_verl``, through VeRL's trainer-side code as
its PPO trainer runs it: ``DataProto``, reward extraction, GRPO advantages, the policy loss
and its aggregation; and the logprobs recomputed through VeRL's padded layout (its
``logprobs_from_logits`` on the model's logits divided by ``meta_info["temperature"]``, as
its actor does) against the rollout's.

    .venv-verl/bin/python tests/verl_checks.py FARM_URL MODEL_DIR BATCH_ID [BATCH_ID ...]

Prints one JSON line of figures; exits non-zero (with the reason) on any mismatch.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import AdvantageEstimator, agg_loss, get_policy_loss_fn
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.reward import extract_reward
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.config import ActorConfig

from prorl_farm.trainer import FarmClient
from prorl_farm.trainer.adapters import to_verl


def recomputed_logprobs(model, data: DataProto) -> torch.Tensor:
    """The actor's logprobs of the responses over the padded batch, as VeRL computes them."""
    batch = data.batch
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.float()
    width = batch["responses"].shape[1]
    logits = logits[:, -width - 1:-1, :] / data.meta_info["temperature"]
    return logprobs_from_logits(logits, batch["responses"])


def main() -> None:
    url, model_dir, *batches = sys.argv[1:]
    farm = FarmClient(url)
    groups = [list(farm.iter_results(b, wait_s=0)) for b in batches]
    farm.http.close()
    out = to_verl(groups, pad_token_id=0, as_torch=True)  # processed logprobs expected
    data = DataProto.from_dict(tensors=out["batch"], non_tensors=out["non_tensor_batch"],
                               meta_info=out["meta_info"])

    # Each sampled token's policy version rides along, through the DataProto's own
    # selection (what a trainer masking by staleness slices).
    versions = data.batch["rollout_versions"]
    assert versions.shape == data.batch["responses"].shape
    assert bool(((versions >= 0) == data.batch["response_mask"].bool()).all())
    first = data.select_idxs([0])
    assert torch.equal(first.batch["rollout_versions"], versions[:1])
    assert list(first.non_tensor_batch["min_version"]) == \
        [int(versions[0][versions[0] >= 0].min())]

    reward, _ = extract_reward(data)  # what the trainer reads: rm_scores
    data.batch["token_level_scores"] = reward
    data.batch["token_level_rewards"] = reward  # no KL penalty in reward
    rewards = [j["reward"] for g in groups for j in g if j["state"] == "done"]
    assert torch.allclose(reward.sum(-1), torch.tensor(rewards, dtype=torch.float32))
    data = compute_advantage(data, AdvantageEstimator.GRPO, num_repeat=1,
                             norm_adv_by_std_in_grpo=True)
    adv = data.batch["advantages"]
    mask = data.batch["response_mask"].bool()
    # GRPO by hand: each row's reward against its group's mean, in its unbiased std.
    for uid in set(data.non_tensor_batch["uid"]):
        rows = np.flatnonzero(data.non_tensor_batch["uid"] == uid)
        r = torch.tensor([rewards[i] for i in rows])
        want = (r - r.mean()) / (r.std() + 1e-6) if len(rows) > 1 else r
        for k, i in enumerate(rows):
            got = adv[i][mask[i]]
            assert torch.allclose(got, torch.full_like(got, float(want[k])), atol=1e-5)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    log_prob = recomputed_logprobs(model, data)
    old = data.batch["rollout_log_probs"]
    err = (log_prob - old).abs()[mask].max().item()
    assert err < 1e-4, f"recomputed logprobs differ from the rollout's by {err}"

    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                         use_dynamic_bsz=False)
    loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode)
    pg_loss, metrics = loss_fn(old_log_prob=old, log_prob=log_prob, advantages=adv,
                               response_mask=data.batch["response_mask"],
                               loss_agg_mode="token-mean", config=config)
    assert torch.isfinite(pg_loss), pg_loss
    entropy_like = agg_loss(loss_mat=-log_prob, loss_mask=data.batch["response_mask"],
                            loss_agg_mode="seq-mean-token-mean")
    assert torch.isfinite(entropy_like)
    print(json.dumps({"rows": len(rewards), "max_logprob_error": err,
                      "temperature": data.meta_info["temperature"],
                      "pg_loss": float(pg_loss), "num_turns": data.non_tensor_batch[
                          "__num_turns__"].tolist(),
                      "metrics": sorted(metrics)}))


if __name__ == "__main__":
    main()
