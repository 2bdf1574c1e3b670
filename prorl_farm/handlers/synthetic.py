"""A handler whose stages sleep or compute for configured times; for tests and benchmarks."""

from __future__ import annotations

import ctypes
import hashlib
import time

import numpy as np
from marshmallow import RAISE, Schema, fields, validate

from prorl_farm.config import STAGES
from prorl_farm.errors import FarmError
from prorl_farm.handlers.base import AgentHandler, JobContext
from prorl_farm.llm.session import BackendSession

_seconds = dict(load_default=0.0, validate=validate.Range(min=0, max=24 * 3600))


class SampleOverride(Schema):
    class Meta:
        unknown = RAISE

    run_s = fields.Float(validate=validate.Range(min=0, max=24 * 3600))
    llm_tokens = fields.Integer(strict=True, validate=validate.Range(min=1, max=4096))


class SyntheticInstance(Schema):
    class Meta:
        unknown = RAISE

    init_s = fields.Float(**_seconds)
    run_s = fields.Float(**_seconds)
    eval_s = fields.Float(**_seconds)
    reward = fields.Float(load_default=1.0, allow_nan=False)
    # Per sample: sample i of the instance earns rewards[i % len(rewards)] (groups whose
    # rewards vary, for dynamic sampling).
    rewards = fields.List(fields.Float(allow_nan=False), validate=validate.Length(min=1,
                                                                                max=4096))
    fail_stage = fields.String(load_default=None, allow_none=True,
                               validate=validate.OneOf(STAGES))
    # Only these samples fail at fail_stage (default: every sample).
    fail_samples = fields.List(fields.Integer(strict=True, validate=validate.Range(min=0)),
                               validate=validate.Length(max=4096))
    # "sleep": wait (I/O-bound stages); "compute": spin the CPU, checking for aborts.
    mode = fields.String(load_default="sleep", validate=validate.OneOf(["sleep", "compute"]))
    # RUN pins the job to an LLM backend and makes this many requests to it (each asking
    # for ``llm_tokens`` tokens of a fixed token prompt); run_s is spent between them.
    llm_turns = fields.Integer(load_default=0, strict=True, validate=validate.Range(min=0,
                                                                                   max=1000))
    llm_tokens = fields.Integer(load_default=4, strict=True, validate=validate.Range(min=1,
                                                                                    max=4096))
    # Hold the interpreter in a C call for this long at the start of this stage, on the
    # job's first attempt only: a wedged pool, for the watchdog's tests.
    wedge_stage = fields.String(load_default=None, allow_none=True,
                                validate=validate.OneOf(STAGES))
    wedge_s = fields.Integer(load_default=0, strict=True, validate=validate.Range(min=0,
                                                                                 max=3600))
    # RUN fabricates a trajectory of this many response tokens (ids, mask, logprobs, in
    # ``trajectory_turns`` sampled turns with observations between them) after a prompt of
    # ``prompt_tokens``: production sizes without a model (synthetic_trajectory).
    trajectory_tokens = fields.Integer(load_default=0, strict=True,
                                       validate=validate.Range(min=0, max=1 << 22))
    prompt_tokens = fields.Integer(load_default=256, strict=True,
                                   validate=validate.Range(min=1, max=1 << 20))
    trajectory_turns = fields.Integer(load_default=1, strict=True,
                                      validate=validate.Range(min=1, max=4096))
    # Per sample: sample i of the instance runs with overrides[i % len] of run_s and
    # llm_tokens (stragglers: one slow rollout in a group, heavy-tailed turn lengths).
    sample_overrides = fields.List(fields.Nested(SampleOverride),
                                   validate=validate.Length(min=1, max=4096))
    # Carried and ignored: gives an instance the size of a real one (benchmarks, tests).
    payload = fields.String(validate=validate.Length(max=64 * 1024 * 1024))


def synthetic_trajectory(seed: str, prompt_tokens: int, response_tokens: int,
                         turns: int = 1, vocab: int = 151_936) -> dict:
    """A trajectory as the agent loop makes one, fabricated from ``seed`` (the same seed:
    the same arrays): ``turns`` sampled segments (mask 1, float32 logprobs as an engine
    returns them) with observations (mask 0, logprob 0) between them."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8],
                                               "little"))
    prompt = rng.integers(0, vocab, prompt_tokens, dtype=np.int32)
    ids = rng.integers(0, vocab, response_tokens, dtype=np.int32)
    logprobs = np.log(rng.uniform(1e-6, 1.0, response_tokens).astype(np.float32))
    mask = np.ones(response_tokens, dtype=np.uint8)
    bounds = np.linspace(0, response_tokens, 2 * turns, endpoint=False).astype(int)[1:]
    turn_records, edges = [], [0, *bounds, response_tokens]
    for i in range(len(edges) - 1):
        lo, hi = edges[i], edges[i + 1]
        if i % 2:  # an observation
            mask[lo:hi] = 0
            logprobs[lo:hi] = 0.0
        else:
            turn_records.append({"offset": int(lo), "prompt_len": int(prompt_tokens + lo),
                                 "generated": int(hi - lo), "finish_reason": "stop",
                                 "backend": "synthetic", "policy_version": 0,
                                 "logprobs_mode": "raw_logprobs"})
    return {"prompt_ids": prompt.tolist(), "response_ids": ids.tolist(),
            "response_mask": mask.tolist(), "response_logprobs": logprobs.tolist(),
            "turns": turn_records, "messages": [{"role": "user", "content": seed}],
            "policy_version": 0}


class SyntheticFailure(FarmError, RuntimeError):
    """The failure a synthetic instance asked for."""


class SyntheticHandler(AgentHandler):
    name = "synthetic"
    description = "Stages that sleep or compute for set times, and fail where told to."
    instance_schema = SyntheticInstance

    def _work(self, ctx: JobContext, seconds: float) -> None:
        if ctx.instance.get("wedge_stage") == ctx.stage and ctx.requeues == 0:
            # libc's sleep through PyDLL keeps the GIL: no thread of the process runs.
            ctypes.PyDLL(None).sleep(ctx.instance.get("wedge_s", 0))
        if ctx.instance.get("mode") == "compute":
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                ctx.check()
                t = time.monotonic() + 0.01
                while time.monotonic() < t:
                    pass
        elif seconds > 0:
            ctx.sleep(seconds)
        else:
            ctx.check()
        if ctx.instance.get("fail_stage") == ctx.stage and (
                "fail_samples" not in ctx.instance
                or ctx.sample_index in ctx.instance["fail_samples"]):
            raise SyntheticFailure(f"synthetic failure in {ctx.stage}")

    @staticmethod
    def _sample(ctx: JobContext, name: str, default):
        """``name`` for this sample: its override where it has one, else the instance's."""
        overrides = ctx.instance.get("sample_overrides")
        if overrides:
            mine = overrides[ctx.sample_index % len(overrides)]
            if name in mine:
                return mine[name]
        return ctx.instance.get(name, default)

    def init(self, ctx: JobContext) -> dict:
        self._work(ctx, ctx.instance.get("init_s", 0.0))
        return {"sandbox": f"synthetic-{ctx.job_id}", "node": ctx.node}

    def run(self, ctx: JobContext) -> dict:
        turns = ctx.instance.get("llm_turns", 0)
        run_s = self._sample(ctx, "run_s", 0.0)
        if not turns:
            self._work(ctx, run_s)
            out = {"sandbox": ctx.state.get("sandbox"), "turns": 1}
            if ctx.instance.get("trajectory_tokens"):
                out.update(synthetic_trajectory(
                    ctx.job_id, ctx.instance["prompt_tokens"],
                    ctx.instance["trajectory_tokens"], ctx.instance["trajectory_turns"]))
            return out
        session = BackendSession.for_job(ctx)
        prompt = [1, 2, 3]
        backends, versions, newest = [], [], []
        with session:
            for _ in range(turns):
                ctx.sleep(run_s / turns)
                t = session.generate(prompt, {"max_tokens": self._sample(ctx, "llm_tokens", 4),
                                              "ignore_eos": True})  # exactly that many
                prompt = prompt + t.generation.token_ids
                backends.append(t.backend.id)
                # The oldest weights that sampled any of the turn's tokens.
                versions.append(min(v for _, v in t.versions))
                newest.append(max(v for _, v in t.versions))
        if ctx.instance.get("fail_stage") == "run":
            raise SyntheticFailure("synthetic failure in run")
        return {"sandbox": ctx.state.get("sandbox"), "turns": turns, "backends": backends,
                "policy_versions": versions, "policy_version": min(versions),
                "min_version": min(versions), "max_version": max(newest),
                "failovers": session.failovers,
                "tokens": len(prompt) - 3}

    def eval(self, ctx: JobContext) -> dict:
        self._work(ctx, ctx.instance.get("eval_s", 0.0))
        rewards = ctx.instance.get("rewards")
        if rewards:
            return {"reward": rewards[ctx.sample_index % len(rewards)]}
        return {"reward": ctx.instance.get("reward", 1.0)}
