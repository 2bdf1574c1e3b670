"""Farm trajectories as the batch layouts trainers read (no dependency on either framework;
numpy arrays, or torch tensors with ``as_torch=True`` where torch is importable).

Input: groups of finished jobs (a :class:`prorl_farm.trainer.dapo.Batch`, a list of
``Group``, or a list of lists of job documents); failed jobs are left out (never a zero
reward). Each trajectory is ``prompt_ids`` + ``response_ids`` with ``response_mask`` (1
where the policy sampled the token) and ``response_logprobs`` (the behaviour policy's, 0.0
where the mask is 0), exactly as the farm recorded them: nothing is re-tokenised.

- :func:`to_verl`: the tensors of VeRL's ``DataProto`` after rollout and reward, as its
  PPO/GRPO trainer reads them (``DataProto.from_dict(tensors=out["batch"],
  non_tensors=out["non_tensor_batch"])``).
- :func:`to_nemo_rl`: NeMo RL's per-sample ``message_log`` and the flat training dict its
  GRPO loop builds with ``batched_message_log_to_flat_message``.

docs/trainers.md names the files of each framework these layouts were matched against.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def _samples(groups: Iterable) -> list[tuple[int, dict]]:
    """(group index, job) for every job that ended done, group by group."""
    out = []
    for g, group in enumerate(groups):
        jobs = group.rollouts if hasattr(group, "rollouts") else group
        out += [(g, job) for job in jobs if job.get("state") == "done"]
    if not out:
        raise ValueError("no finished (done) trajectories to train on")
    return out


def _uid(group, g: int) -> str:
    return getattr(group, "batch_id", None) or str(g)


def _torch(arrays: dict, as_torch: bool) -> dict:
    if not as_torch:
        return arrays
    import torch

    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def to_verl(groups, pad_token_id: int = 0, as_torch: bool = False) -> dict:
    """VeRL: ``prompts`` left-padded, ``responses`` right-padded, ``input_ids`` (their
    concatenation), ``attention_mask``, ``position_ids``, ``response_mask`` (the loss mask:
    sampled tokens only), ``rollout_log_probs``, ``token_level_scores`` (the reward on the
    last response token) and ``token_level_rewards`` (the same, before any KL penalty);
    ``uid`` per group and ``policy_version`` per sample in ``non_tensor_batch``."""
    groups = list(groups)
    samples = _samples(groups)
    b = len(samples)
    p = max(len(job["result"]["prompt_ids"]) for _, job in samples)
    r = max(max(len(job["result"]["response_ids"]) for _, job in samples), 1)
    prompts = np.full((b, p), pad_token_id, dtype=np.int64)
    prompt_mask = np.zeros((b, p), dtype=np.int64)
    responses = np.full((b, r), pad_token_id, dtype=np.int64)
    response_attn = np.zeros((b, r), dtype=np.int64)
    response_mask = np.zeros((b, r), dtype=np.int64)
    logprobs = np.zeros((b, r), dtype=np.float32)
    scores = np.zeros((b, r), dtype=np.float32)
    uids, versions = [], []
    for i, (g, job) in enumerate(samples):
        res = job["result"]
        prompt, response = res["prompt_ids"], res["response_ids"]
        prompts[i, p - len(prompt):] = prompt
        prompt_mask[i, p - len(prompt):] = 1
        responses[i, :len(response)] = response
        response_attn[i, :len(response)] = 1
        response_mask[i, :len(response)] = res["response_mask"]
        logprobs[i, :len(response)] = res["response_logprobs"]
        if len(response):
            scores[i, len(response) - 1] = job["reward"]
        uids.append(_uid(groups[g], g))
        versions.append(job.get("policy_version"))
    attention_mask = np.concatenate([prompt_mask, response_attn], axis=1)
    position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None) * attention_mask
    batch = {"prompts": prompts, "responses": responses,
             "input_ids": np.concatenate([prompts, responses], axis=1),
             "attention_mask": attention_mask, "position_ids": position_ids,
             "response_mask": response_mask, "rollout_log_probs": logprobs,
             "token_level_scores": scores, "token_level_rewards": scores.copy()}
    return {"batch": _torch(batch, as_torch),
            "non_tensor_batch": {"uid": np.array(uids, dtype=object),
                                 "policy_version": np.array(versions, dtype=object)},
            "meta_info": {}}


def _runs(mask) -> list[tuple[int, int, int]]:
    """(start, end, value) of the runs of equal values in ``mask``."""
    mask = np.asarray(mask)
    if not len(mask):
        return []
    starts = np.flatnonzero(np.diff(mask)) + 1
    edges = [0, *starts.tolist(), len(mask)]
    return [(a, b, int(mask[a])) for a, b in zip(edges, edges[1:])]


def to_nemo_rl(groups, pad_token_id: int = 0, as_torch: bool = False) -> dict:
    """NeMo RL: ``message_log`` per sample (the prompt as one ``user`` message; then each
    run of sampled tokens as an ``assistant`` message with its ``generation_logprobs`` and
    ``token_loss_mask`` 1, each run of other tokens, observations and template glue, as an
    ``environment`` message with mask 0; ``token_ids`` in every message), and the flat dict
    of its GRPO step: ``input_ids`` right-padded, ``input_lengths``, ``token_mask``,
    ``generation_logprobs``, ``sample_mask``, ``total_reward`` and ``idx`` (the group)."""
    groups = list(groups)
    samples = _samples(groups)
    logs = []
    for _, job in samples:
        res = job["result"]
        response, mask = res["response_ids"], res["response_mask"]
        log = [{"role": "user", "token_ids": np.array(res["prompt_ids"], dtype=np.int64),
                "token_loss_mask": np.zeros(len(res["prompt_ids"]), dtype=np.int64),
                "generation_logprobs": np.zeros(len(res["prompt_ids"]), dtype=np.float32)}]
        for start, end, value in _runs(mask):
            log.append({"role": "assistant" if value else "environment",
                        "token_ids": np.array(response[start:end], dtype=np.int64),
                        "token_loss_mask": np.full(end - start, value, dtype=np.int64),
                        "generation_logprobs": np.array(res["response_logprobs"][start:end],
                                                        dtype=np.float32)})
        logs.append(log)
    lengths = np.array([sum(len(m["token_ids"]) for m in log) for log in logs], dtype=np.int64)
    width = int(lengths.max())
    input_ids = np.full((len(logs), width), pad_token_id, dtype=np.int64)
    token_mask = np.zeros((len(logs), width), dtype=np.int64)
    gen_logprobs = np.zeros((len(logs), width), dtype=np.float32)
    for i, log in enumerate(logs):
        at = 0
        for m in log:
            n = len(m["token_ids"])
            input_ids[i, at:at + n] = m["token_ids"]
            token_mask[i, at:at + n] = m["token_loss_mask"]
            gen_logprobs[i, at:at + n] = m["generation_logprobs"]
            at += n
    flat = {"input_ids": input_ids, "input_lengths": lengths, "token_mask": token_mask,
            "generation_logprobs": gen_logprobs,
            "sample_mask": np.ones(len(logs), dtype=np.float32),
            "total_reward": np.array([job["reward"] for _, job in samples], dtype=np.float32),
            "idx": np.array([g for g, _ in samples], dtype=np.int64)}
    return {"message_log": logs, "flat": _torch(flat, as_torch)}
