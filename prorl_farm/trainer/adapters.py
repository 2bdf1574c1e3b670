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

NeMo RL takes the farm's rollouts through NeMo Gym instead: the farm is a Gym agent server
(prorl_farm/gym/, docs/trainers.md).

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
    return getattr(group, "uid", None) or getattr(group, "batch_id", None) or str(g)


def token_versions(result: dict, policy_version=None) -> np.ndarray:
    """The policy version that sampled each response token (int64, one per response
    token; -1 where the policy sampled nothing: observations, template glue), from the
    trajectory's ``version_boundaries`` ([response index, version] where it changes)."""
    n = len(result["response_ids"])
    bounds = result.get("version_boundaries")
    if not bounds:  # a trajectory recorded before boundaries: one version throughout
        v = result.get("policy_version", policy_version)
        bounds = [[0, -1 if v is None else v]]
    out = np.full(n, -1, dtype=np.int64)
    for (start, v), nxt in zip(bounds, [*bounds[1:], [n, None]]):
        out[int(start):int(nxt[0])] = int(v)
    out[np.asarray(result["response_mask"], dtype=bool) == 0] = -1
    return out


def version_range(rows: np.ndarray) -> tuple[list, list]:
    """Per row of per-token versions (-1: not sampled), its oldest and newest version (None
    for a row with no sampled token)."""
    sampled = [row[row >= 0] for row in rows]
    return ([int(v.min()) if len(v) else None for v in sampled],
            [int(v.max()) if len(v) else None for v in sampled])


def _torch(arrays: dict, as_torch: bool) -> dict:
    if not as_torch:
        return arrays
    import torch

    return {k: torch.from_numpy(v) for k, v in arrays.items()}


# Sampling under which an engine's raw and processed logprobs are the same numbers.
_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _temperature(samples: list[tuple[int, dict]]) -> float:
    """The one sampling temperature of the batch (the trainer divides its logits by it)."""
    temps = {float((job.get("sampling") or {}).get("temperature", 1.0)) for _, job in samples}
    if len(temps) > 1:
        raise ValueError(f"the batch mixes sampling temperatures {sorted(temps)}: a trainer "
                         "recomputes logprobs at one temperature; train them apart")
    return temps.pop()


def check_logprobs_mode(samples: list[tuple[int, dict]], wanted: str | None) -> None:
    """Refuse trajectories whose logprobs are not what the trainer computes: each turn
    records its backend's mode (``raw_logprobs``: before temperature and truncation;
    ``processed_logprobs``: after them, what VeRL's actor computes). They differ unless
    the sampling is neutral (temperature 1, no top-p/top-k/min-p, no penalties)."""
    if wanted is None:
        return
    for _, job in samples:
        sampling = job.get("sampling") or {}
        neutral = all(float(sampling.get(k, v)) == v for k, v in _NEUTRAL.items())
        for turn in (job.get("result") or {}).get("turns") or ():
            mode = turn.get("logprobs_mode")
            if mode and mode != wanted and not neutral:
                raise ValueError(
                    f"job {job.get('id')}: its turns' logprobs are {mode} at temperature "
                    f"{sampling.get('temperature', 1.0)}, the trainer computes {wanted}: the "
                    "importance ratios would be off. Register the backends with logprobs_mode="
                    f"{wanted!r} (vLLM: --logprobs-mode {wanted}), or pass logprobs_mode="
                    f"{mode!r} if the trainer computes those")


def to_verl(groups, pad_token_id: int = 0, as_torch: bool = False,
            logprobs_mode: str | None = "processed_logprobs") -> dict:
    """VeRL: ``prompts`` left-padded, ``responses`` right-padded, ``input_ids`` (their
    concatenation), ``attention_mask``, ``position_ids``, ``response_mask`` (the loss mask:
    sampled tokens only), ``rollout_log_probs``, ``rm_scores`` (the reward on the last
    response token, where VeRL's agent loop puts it; its trainer reads the reward there),
    ``token_level_scores`` and ``token_level_rewards`` (the same, before any KL penalty),
    ``rollout_versions`` (the policy version that sampled each response token, -1 where
    none did: weight or mask by staleness with it);
    in ``non_tensor_batch`` ``uid`` per group, ``policy_version`` (the oldest token's),
    ``min_version``, ``max_version``, ``__num_turns__`` and
    ``multi_modal_inputs`` (empty for text) per sample; ``meta_info["temperature"]`` (the
    actor divides its logits by it). ``logprobs_mode``: what the trainer computes (VeRL's
    rollout default, ``processed_logprobs``): trajectories sampled with other logprobs under
    non-neutral sampling are refused (:func:`check_logprobs_mode`); None checks nothing."""
    groups = list(groups)
    samples = _samples(groups)
    check_logprobs_mode(samples, logprobs_mode)
    temperature = _temperature(samples)
    b = len(samples)
    prompts, prompt_mask, responses, response_attn, response_mask, logprobs, scores, \
        token_vers = _padded(samples, pad_token_id)
    uids = [_uid(groups[g], g) for g, _ in samples]
    versions = [job.get("policy_version") for _, job in samples]
    # VeRL counts chat turns: the prompt, then each assistant or tool/user message.
    turns = [1 + len(mask_runs(job["result"]["response_mask"])) for _, job in samples]
    attention_mask = np.concatenate([prompt_mask, response_attn], axis=1)
    position_ids = np.clip(np.cumsum(attention_mask, axis=1) - 1, 0, None) * attention_mask
    batch = {"prompts": prompts, "responses": responses,
             "input_ids": np.concatenate([prompts, responses], axis=1),
             "attention_mask": attention_mask, "position_ids": position_ids,
             "response_mask": response_mask, "rollout_log_probs": logprobs,
             "rm_scores": scores, "token_level_scores": scores.copy(),
             "token_level_rewards": scores.copy(), "rollout_versions": token_vers}
    oldest, newest = version_range(token_vers)
    multi_modal = np.empty(b, dtype=object)
    multi_modal[:] = [{} for _ in range(b)]
    return {"batch": _torch(batch, as_torch),
            "non_tensor_batch": {"uid": np.array(uids, dtype=object),
                                 "policy_version": np.array(versions, dtype=object),
                                 "min_version": np.array(oldest, dtype=object),
                                 "max_version": np.array(newest, dtype=object),
                                 "__num_turns__": np.array(turns, dtype=np.int32),
                                 "multi_modal_inputs": multi_modal},
            "meta_info": {"temperature": temperature}}


def _padded(samples, pad_token_id: int) -> tuple[np.ndarray, ...]:
    """The samples' arrays as VeRL lays them out: prompts left-padded and their mask;
    responses right-padded, their attention and loss masks, logprobs, the reward on the
    last response token, and each token's policy version (-1 where none sampled it)."""
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
    token_vers = np.full((b, r), -1, dtype=np.int64)
    for i, (_, job) in enumerate(samples):
        res = job["result"]
        prompt, response = res["prompt_ids"], res["response_ids"]
        prompts[i, p - len(prompt):] = prompt
        prompt_mask[i, p - len(prompt):] = 1
        responses[i, :len(response)] = response
        response_attn[i, :len(response)] = 1
        response_mask[i, :len(response)] = res["response_mask"]
        logprobs[i, :len(response)] = res["response_logprobs"]
        token_vers[i, :len(response)] = token_versions(res, job.get("policy_version"))
        # An empty response's reward goes where VeRL's agent loop puts it: at index -1.
        scores[i, len(response) - 1 if len(response) else -1] = job["reward"]
    return (prompts, prompt_mask, responses, response_attn, response_mask, logprobs, scores,
            token_vers)


def mask_runs(mask) -> list[tuple[int, int, int]]:
    """(start, end, value) of the runs of equal values in ``mask``."""
    mask = np.asarray(mask)
    if not len(mask):
        return []
    starts = np.flatnonzero(np.diff(mask)) + 1
    edges = [0, *starts.tolist(), len(mask)]
    return [(a, b, int(mask[a])) for a, b in zip(edges, edges[1:])]
