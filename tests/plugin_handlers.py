"""Handlers used by tests through PRORL_HANDLERS and entry points (a test double of a task)."""

from __future__ import annotations

from prorl_farm.errors import BackendUnavailable, InvalidInstance
from prorl_farm.handlers.base import AgentHandler, JobContext


class EchoHandler(AgentHandler):
    """Any JSON object; ``behaviour`` picks a way to misbehave in a stage."""

    name = "echo"
    description = "Echoes its instance; misbehaves on request."

    def init(self, ctx: JobContext) -> dict:
        if ctx.instance.get("behaviour") == "invalid":
            raise InvalidInstance("the repository in this instance does not exist")
        return {"seen": ctx.instance, "sampling": ctx.sampling}

    def run(self, ctx: JobContext) -> dict:
        if ctx.instance.get("behaviour") == "no-backend":
            raise BackendUnavailable("every backend refused")
        return {"echo": ctx.state["seen"], "sampling": ctx.state["sampling"],
                "sample_index": ctx.sample_index}

    def eval(self, ctx: JobContext):
        if ctx.instance.get("behaviour") == "bad-reward":
            return {"reward": float("nan")}
        if ctx.instance.get("behaviour") == "zero":
            return 0.0
        return {"reward": 1.0, "checked": ctx.result["echo"] == ctx.instance}


class BrokenHandler(AgentHandler):
    """Fails to construct: the registry must skip it, not die."""

    name = "broken"

    def __init__(self):
        raise RuntimeError("plugin cannot start")

    def init(self, ctx):  # pragma: no cover
        return None

    def run(self, ctx):  # pragma: no cover
        return None

    def eval(self, ctx):  # pragma: no cover
        return 0.0
