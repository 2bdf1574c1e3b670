"""The trainer adapters: VeRL's DataProto tensors and NeMo RL's message logs and flat
batch, built from farm trajectories without re-tokenising anything."""

from __future__ import annotations

import numpy as np
import pytest

from prorl_farm.trainer.adapters import to_verl


def _job(prompt, response, mask, reward, state="done", version=3):
    logprobs = [-0.1 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    return {"id": f"j{len(prompt)}{len(response)}{reward}", "state": state, "reward": reward,
            "policy_version": version,
            "result": {"prompt_ids": prompt, "response_ids": response, "response_mask": mask,
                       "response_logprobs": logprobs}}


# Two groups; in the second, a failed rollout (left out, never a zero reward).
GROUPS = [
    [_job([5, 6, 7], [10, 11, 90, 91, 12], [1, 1, 0, 0, 1], 1.0),
     _job([5, 6, 7], [13], [1], 0.0)],
    [_job([8, 9], [14, 15, 92, 16, 17, 18], [1, 1, 0, 1, 1, 1], 0.5),
     _job([8, 9], [], [], None, state="failed")],
]


def test_verl_layout_lines_up_tokens_masks_logprobs_and_scores():
    out = to_verl(GROUPS, pad_token_id=0)
    t = out["batch"]
    assert t["prompts"].shape == (3, 3) and t["responses"].shape == (3, 6)
    assert t["prompts"][2].tolist() == [0, 8, 9]  # left-padded
    assert t["responses"][1].tolist() == [13, 0, 0, 0, 0, 0]  # right-padded
    assert np.array_equal(t["input_ids"], np.concatenate([t["prompts"], t["responses"]], 1))
    for i, job in enumerate([GROUPS[0][0], GROUPS[0][1], GROUPS[1][0]]):
        res = job["result"]
        real = t["input_ids"][i][t["attention_mask"][i] == 1].tolist()
        assert real == res["prompt_ids"] + res["response_ids"]
        n = len(res["response_ids"])
        assert t["response_mask"][i, :n].tolist() == res["response_mask"]
        assert t["response_mask"][i, n:].sum() == 0
        assert t["rollout_log_probs"][i, :n].tolist() == pytest.approx(
            res["response_logprobs"])
        # The reward sits on the last response token, nowhere else.
        assert t["token_level_scores"][i, n - 1] == job["reward"]
        assert t["token_level_scores"][i].sum() == job["reward"]
        # Positions count real tokens from 0.
        pos = t["position_ids"][i][t["attention_mask"][i] == 1]
        assert pos.tolist() == list(range(len(real)))
    assert out["non_tensor_batch"]["uid"].tolist() == ["0", "0", "1"]
    assert out["non_tensor_batch"]["policy_version"].tolist() == [3, 3, 3]


def test_torch_tensors_where_torch_is_importable():
    torch = pytest.importorskip("torch")
    out = to_verl(GROUPS, as_torch=True)
    assert isinstance(out["batch"]["input_ids"], torch.Tensor)
    assert out["batch"]["input_ids"].dtype == torch.int64


def test_nothing_finished_is_an_error_not_an_empty_batch():
    with pytest.raises(ValueError, match="no finished"):
        to_verl([[GROUPS[1][1]]])


def _sampled(job, temperature, mode, **sampling):
    out = dict(job, sampling={"temperature": temperature, **sampling})
    out["result"] = dict(job["result"], turns=[{"offset": 0, "logprobs_mode": mode}])
    return out


def test_verl_gets_the_reward_where_its_trainer_reads_it_and_the_keys_it_reads():
    empty = _job([4, 5], [], [], 0.25)
    out = to_verl([[GROUPS[0][0], empty]], pad_token_id=0)
    t, nt = out["batch"], out["non_tensor_batch"]
    assert np.array_equal(t["rm_scores"], t["token_level_scores"])
    assert t["rm_scores"][0, 4] == 1.0 and t["rm_scores"][0].sum() == 1.0
    # An empty response: its reward at index -1, as VeRL's agent loop places it.
    assert t["rm_scores"][1, -1] == 0.25 and t["rm_scores"][1].sum() == 0.25
    assert nt["__num_turns__"].tolist() == [4, 1]  # prompt, assistant, tool, assistant
    assert nt["__num_turns__"].dtype == np.int32
    assert nt["multi_modal_inputs"].tolist() == [{}, {}]
    assert out["meta_info"] == {"temperature": 1.0}


def test_verl_refuses_logprobs_its_actor_does_not_compute():
    raw = [[_sampled(j, 0.7, "raw_logprobs") for j in GROUPS[0]]]
    with pytest.raises(ValueError, match="raw_logprobs at temperature 0.7.*processed_logprobs"):
        to_verl(raw)
    # What the backend computed, said by the trainer that computes the same: accepted.
    assert to_verl(raw, logprobs_mode="raw_logprobs")["meta_info"] == {"temperature": 0.7}
    processed = [[_sampled(j, 0.7, "processed_logprobs") for j in GROUPS[0]]]
    assert to_verl(processed)["meta_info"] == {"temperature": 0.7}
    # Neutral sampling: raw and processed are the same numbers.
    assert to_verl([[_sampled(j, 1.0, "raw_logprobs") for j in GROUPS[0]]])
    with pytest.raises(ValueError, match="raw_logprobs"):
        to_verl([[_sampled(j, 1.0, "raw_logprobs", top_p=0.9) for j in GROUPS[0]]])
    mixed = [[_sampled(GROUPS[0][0], 0.7, "processed_logprobs"),
              _sampled(GROUPS[0][1], 1.0, "processed_logprobs")]]
    with pytest.raises(ValueError, match="mixes sampling temperatures"):
        to_verl(mixed)


def test_versions_per_token_reach_both_layouts():
    """A rollout that went on across a weight update: its tokens' versions, per token, in
    VeRL's batch and NeMo RL's messages and flat dict; -1 where the policy sampled nothing."""
    crossed = _job([5, 6], [10, 11, 90, 12, 13, 14], [1, 1, 0, 1, 1, 1], 1.0, version=3)
    crossed["result"]["version_boundaries"] = [[0, 3], [4, 4]]  # update after token 12
    plain = GROUPS[0][1]  # recorded before boundaries: its policy_version throughout
    out = to_verl([[crossed, plain]], pad_token_id=0)
    vers = out["batch"]["rollout_versions"]
    assert vers.dtype == np.int64 and vers.shape == (2, 6)
    assert vers[0].tolist() == [3, 3, -1, 3, 4, 4]
    assert vers[1].tolist() == [3, -1, -1, -1, -1, -1]  # padding: -1
    nt = out["non_tensor_batch"]
    assert nt["min_version"].tolist() == [3, 3] and nt["max_version"].tolist() == [4, 3]


def test_a_step_reports_staleness_by_token_and_queue_time_apart_from_running():
    """DynamicSampler's per-step report over the rollouts it returns: versions behind the
    step's policy of each rollout's oldest token (mean, max) and of every sampled token,
    and the seconds its rollouts waited in queues against the seconds they ran."""
    from prorl_farm.trainer.dapo import Group, StepStats, _age

    crossed = _job([5, 6], [10, 11, 90, 12, 13, 14], [1, 1, 0, 1, 1, 1], 1.0, version=3)
    crossed["result"]["version_boundaries"] = [[0, 3], [4, 4]]
    crossed["timings"] = {"init": {"queue_wait_s": 0.5, "active_s": 1.0},
                          "run": {"queue_wait_s": 1.5, "active_s": 4.0}, "total_s": 7.0}
    fresh = _job([5, 6], [20, 21], [1, 1], 0.0, version=5)
    fresh["result"]["version_boundaries"] = [[0, 5]]
    fresh["timings"] = {"run": {"queue_wait_s": 0.0, "active_s": 2.0}}
    group = Group({}, "b", [crossed["id"], fresh["id"]], 3, 0.0,
                  jobs={crossed["id"]: crossed, fresh["id"]: fresh})
    assert group.policy_version == 3  # the oldest token's, not the newest
    stats = StepStats(step=0)
    _age(stats, [group], policy_version=5)
    assert (stats.staleness_mean, stats.staleness_max) == (1.0, 2)
    # Tokens: 3 at version 3 (2 behind), 2 at version 4 (1), 2 at version 5 (0).
    assert stats.token_staleness_mean == pytest.approx(8 / 7, abs=1e-4)
    assert (stats.queue_wait_mean_s, stats.active_mean_s) == (1.0, 3.5)
