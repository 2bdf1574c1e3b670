"""What the tool-using handlers (math, stem, code, swe) share: the agent options of their
instances, a sandbox for their tools, and one episode of the agent loop, or of the agent
harness an instance names in ``agent`` (prorl_farm/harness/)."""

from __future__ import annotations

from marshmallow import RAISE, Schema, fields, validate

from prorl_farm.agent.loop import AgentLimits, Episode, run_episode
from prorl_farm.agent.parsers import PARSERS, get_parser
from prorl_farm.agent.tools import ToolRunner
from prorl_farm.agent.trajectory import Trajectory
from prorl_farm.handlers.base import AgentHandler, JobContext
from prorl_farm.harness import HarnessOptions, run_harness
from prorl_farm.sandbox.abstract import SandboxSpec
from prorl_farm.sandbox.connection import ToolConnection
from prorl_farm.sandbox.runtimes import GATEWAY_RUNTIMES

# Fields every agent instance may set, all visible to the policy.
AGENT_OPTIONS = ("tools", "system", "parser", "max_turns", "call_timeout_s",
                 "observation_chars", "agent")


class LoopOptions(Schema):
    """The agent loop's limits an instance may set."""

    class Meta:
        unknown = RAISE

    parser = fields.String(load_default="hermes", validate=validate.OneOf(sorted(PARSERS)))
    max_turns = fields.Integer(load_default=None, allow_none=True, strict=True,
                               validate=validate.Range(min=1, max=1000))
    call_timeout_s = fields.Float(load_default=None, allow_none=True,
                                  validate=validate.Range(min=0.1, max=3600))
    # A tool result longer than this keeps its head and tail (the loop says what was cut).
    observation_chars = fields.Integer(load_default=None, allow_none=True, strict=True,
                                       validate=validate.Range(min=256, max=1_000_000))


class AgentOptions(LoopOptions):
    """The agent loop's per-instance options (handlers add their task fields and ``tools``)."""

    system = fields.String(load_default=None, allow_none=True)
    # An agent harness instead of the built-in loop: it runs in the job's sandbox and calls
    # the model through the job's gateway.
    agent = fields.Nested(HarnessOptions, load_default=None, allow_none=True)


class ToolAgentHandler(AgentHandler):
    """INIT starts a sandbox when the instance asks for tools (never in reference mode);
    :meth:`episode` runs the agent loop with them."""

    # Tools offered beside the instance's own (e.g. ``submit``).
    extra_tools: tuple[str, ...] = ()
    property_schemas = {"agent": HarnessOptions.json_schema()}

    def init(self, ctx: JobContext) -> dict:
        if ctx.mode == "reference" or not (ctx.instance.get("tools") or
                                           ctx.instance.get("agent")):
            return {}
        sandbox = ctx.sandboxes.start(self.sandbox_spec(ctx), ctx.job_id, ctx.requeues, ctx)
        return {"sandbox": sandbox.to_dict()}

    def allowed_by(self, settings) -> dict:
        return {} if _harnesses_run(settings) else {"agent": {"enum": [None]}}

    def refusals(self, instance: dict, settings) -> dict:
        if instance.get("agent") and not _harnesses_run(settings):
            return {"agent": [f"agent harnesses run in {' or '.join(GATEWAY_RUNTIMES)} "
                              f"sandboxes (the runtimes with the model gateway's door); "
                              f"this farm's runtime is {settings.sandbox_runtime}"]}
        return {}

    @staticmethod
    def sandbox_spec(ctx: JobContext, **spec) -> SandboxSpec:
        """The job's sandbox: with the gateway (and the harness environments) when an
        agent harness runs in it."""
        if ctx.instance.get("agent"):
            spec.update(gateway=True, harnesses=ctx.settings.harness_path)
        return SandboxSpec(**spec)

    def reference(self, ctx: JobContext) -> dict:
        """Reference mode for answer tasks: the reference, boxed, as the final answer."""
        return {"messages": [{"role": "assistant",
                              "content": f"\\boxed{{{ctx.instance['answer']}}}"}],
                "stats": {"end_reason": "answered"}}

    def episode(self, ctx: JobContext, user_text: str, harness_text: str | None = None
                ) -> dict:
        """One episode from ``user_text``: the trajectory, the episode's ``stats`` and what
        the policy ``submitted`` (the RUN result). An instance's harness gets
        ``harness_text`` (default ``user_text``): the task, without the built-in loop's tool
        instructions."""
        if ctx.instance.get("agent"):
            return run_harness(ctx, ctx.instance["agent"], harness_text or user_text)
        traj, ep = self._episode(ctx, user_text)
        return {**traj.to_dict(), "stats": ep.stats(), "submitted": ep.submitted}

    def _episode(self, ctx: JobContext, user_text: str) -> tuple[Trajectory, Episode]:
        inst = ctx.instance
        messages = ([{"role": "system", "content": inst["system"]}] if inst.get("system")
                    else [])
        messages.append({"role": "user", "content": user_text})
        limits = AgentLimits.from_job(inst, ctx.sampling)
        sandbox = ctx.state.get("sandbox")
        client = ToolConnection(sandbox["socket"]) if sandbox else None
        try:
            runner = ToolRunner(client, limits.call_timeout_s) if client else None
            return run_episode(ctx, messages, list(inst.get("tools") or []) +
                               list(self.extra_tools), get_parser(inst["parser"]), limits,
                               runner)
        finally:
            if client is not None:
                client.close()


def _harnesses_run(settings) -> bool:
    return settings.sandbox_runtime in ("auto", *GATEWAY_RUNTIMES)


def final_answer(result: dict) -> str:
    """The policy's final answer: a harness's as its rule took it (``answer``), else the
    final message, if the episode ended with an answer (else "")."""
    if isinstance((result or {}).get("answer"), dict):
        return result["answer"].get("text") or ""
    if (result or {}).get("stats", {}).get("end_reason") != "answered":
        return ""
    return next((m["content"] for m in reversed(result.get("messages", []))
                 if m["role"] == "assistant"), "")


def no_answer(result: dict, verdict: str) -> str:
    """``verdict``, with why a harness gave no answer where it gave none."""
    answer = (result or {}).get("answer")
    if isinstance(answer, dict) and not answer.get("rule") and answer.get("reason"):
        return f"no answer ({answer['reason']}): {verdict}"
    return verdict
