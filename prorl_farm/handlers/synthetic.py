"""A handler whose stages sleep or compute for configured times; for tests and benchmarks."""

from __future__ import annotations

import time

from marshmallow import RAISE, Schema, fields, validate

from prorl_farm.config import STAGES
from prorl_farm.handlers.base import AgentHandler, JobContext

_seconds = dict(load_default=0.0, validate=validate.Range(min=0, max=24 * 3600))


class SyntheticInstance(Schema):
    class Meta:
        unknown = RAISE

    init_s = fields.Float(**_seconds)
    run_s = fields.Float(**_seconds)
    eval_s = fields.Float(**_seconds)
    reward = fields.Float(load_default=1.0, allow_nan=False)
    fail_stage = fields.String(load_default=None, allow_none=True,
                               validate=validate.OneOf(STAGES))
    # "sleep": wait (I/O-bound stages); "compute": spin the CPU, checking for aborts.
    mode = fields.String(load_default="sleep", validate=validate.OneOf(["sleep", "compute"]))


class SyntheticFailure(RuntimeError):
    """The failure a synthetic instance asked for."""


class SyntheticHandler(AgentHandler):
    name = "synthetic"
    description = "Stages that sleep or compute for set times, and fail where told to."
    instance_schema = SyntheticInstance

    def _work(self, ctx: JobContext, seconds: float) -> None:
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
        if ctx.instance.get("fail_stage") == ctx.stage:
            raise SyntheticFailure(f"synthetic failure in {ctx.stage}")

    def init(self, ctx: JobContext) -> dict:
        self._work(ctx, ctx.instance.get("init_s", 0.0))
        return {"sandbox": f"synthetic-{ctx.job_id}", "node": ctx.node}

    def run(self, ctx: JobContext) -> dict:
        self._work(ctx, ctx.instance.get("run_s", 0.0))
        return {"sandbox": ctx.state.get("sandbox"), "turns": 1}

    def eval(self, ctx: JobContext) -> dict:
        self._work(ctx, ctx.instance.get("eval_s", 0.0))
        return {"reward": ctx.instance.get("reward", 1.0)}
