"""The agent loop every tool-using handler shares.

The tools' JSON schemas go through the model's chat template once, into ``prompt_ids``.
Then per turn: generate (token-in/token-out, on the job's sticky backend), parse the tool
calls from the sampled text, run each through the sandbox's tool server, append the results
as ``tool`` messages (mask 0), until the policy submits, answers without a call (where the
handler takes that as its final answer), or a limit ends the episode: turns, generated
tokens in total, the model's context length (a turn that would not fit ends the episode with
a reason, not a backend 400), or the deadline. Malformed calls get an error observation, are
counted, and the episode goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prorl_farm.agent.parsers import ToolCall, ToolParser
from prorl_farm.agent.tools import SCHEMAS, BadArguments, ToolRunner, truncate
from prorl_farm.agent.trajectory import Trajectory, load_chat_tokens
from prorl_farm.context import JobContext
from prorl_farm.errors import StageTimeout
from prorl_farm.llm.session import BackendSession, turn_seed

# End reasons (recorded in the result's ``stats.end_reason``).
SUBMITTED, ANSWERED, MAX_TURNS, MAX_TOKENS, CONTEXT, TIMEOUT = (
    "submitted", "answered", "max_turns", "max_tokens", "context", "timeout")
# The context a job may fill unless its request says otherwise, and never more than its
# engine's own (max_model_len, read when the backend registers).
CONTEXT_LENGTH = 32_768


@dataclass
class AgentLimits:
    max_turns: int = 20
    max_total_tokens: int = 16_384  # generated, all turns together
    max_tokens_per_turn: int = 2_048
    context_length: int = CONTEXT_LENGTH
    call_timeout_s: float = 60.0
    observation_chars: int = 8_000
    # A turn with no tool call ends the episode (its text is the final answer).
    answer_ends: bool = True

    @classmethod
    def from_job(cls, instance: dict, sampling: dict, **defaults) -> AgentLimits:
        """Defaults, then the request's ``sampling`` (max_turns, max_tokens per turn,
        max_total_tokens, context_length), then the instance's own limits."""
        lim = cls(**defaults)
        for key, attr in (("max_turns", "max_turns"), ("max_tokens", "max_tokens_per_turn"),
                          ("max_total_tokens", "max_total_tokens"),
                          ("context_length", "context_length")):
            for source in (sampling, instance):
                if source.get(key) is not None:
                    setattr(lim, attr, int(source[key]))
        if instance.get("call_timeout_s") is not None:
            lim.call_timeout_s = float(instance["call_timeout_s"])
        if instance.get("observation_chars") is not None:
            lim.observation_chars = int(instance["observation_chars"])
        return lim


@dataclass
class Episode:
    """What happened, beside the trajectory."""

    end_reason: str = ""
    turns: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    tool_errors: int = 0
    malformed_calls: int = 0
    tool_s: float = 0.0
    llm_s: float = 0.0
    submitted: dict | None = None  # the submit call's arguments

    def stats(self) -> dict:
        return {"end_reason": self.end_reason, "turns": self.turns, "calls": self.calls,
                "tool_errors": self.tool_errors, "malformed_calls": self.malformed_calls,
                "tool_s": round(self.tool_s, 6), "llm_s": round(self.llm_s, 6)}


def run_episode(ctx: JobContext, messages: list[dict], tools: list[str], parser: ToolParser,
                limits: AgentLimits, runner: ToolRunner | None,
                schemas: dict[str, dict] | None = None) -> tuple[Trajectory, Episode]:
    """Drive one episode; returns the trajectory and what happened. ``tools`` are names of
    the farm's own tools (``SCHEMAS``) or of ``schemas`` (a task's own, which ``runner``
    runs). Raises on backend
    failure (BackendUnavailable) and cancellation. A passed deadline raises StageTimeout:
    the job fails ``timeout`` (a deadline is never graded as a zero reward), carrying the
    episode so far, end reason ``timeout``, when at least one turn was taken."""
    session = BackendSession.for_job(ctx)
    with session:
        first, chat = session.first_backend(load_chat_tokens)
        offered = [(schemas or {}).get(t) or SCHEMAS[t] for t in tools] or None
        traj = Trajectory.start(chat, messages, offered)
        ep = Episode()
        offered = set(tools)
        try:
            _loop(ctx, session, traj, ep, offered, parser, limits, runner)
        except StageTimeout as e:
            if not traj.turns:
                raise
            ep.end_reason = TIMEOUT
            raise StageTimeout(str(e), partial={**traj.to_dict(), "stats": ep.stats()}
                               ) from e
    return traj, ep


def _loop(ctx, session, traj, ep, offered, parser, limits, runner) -> None:
    generated = 0
    for turn in range(limits.max_turns):
        ctx.check()
        context = traj.context()
        budget = limits.max_total_tokens - generated
        room = session.room(limits.context_length, len(context), first_turn=turn == 0)
        if budget <= 0:
            ep.end_reason = MAX_TOKENS
            return
        if room <= 0:
            ep.end_reason = CONTEXT
            return
        # The clients pass on only the sampling parameters a backend knows.
        sampling = dict(ctx.sampling, max_tokens=min(limits.max_tokens_per_turn, budget, room),
                        seed=turn_seed(ctx, turn))
        # A turn cut by its length was cut by the context when that was the nearer limit.
        cut = CONTEXT if room < min(limits.max_tokens_per_turn, budget) else MAX_TOKENS
        t0 = time.monotonic()
        got = session.generate(context, sampling)
        ep.llm_s += time.monotonic() - t0
        g = got.generation
        traj.add_turn(context, got)
        generated += len(g.token_ids)
        ep.turns += 1
        if not offered:  # no tools: the turn is the answer, whatever it says
            ep.end_reason = cut if g.finish_reason == "length" else ANSWERED
            return
        parsed = parser.parse(traj.messages[-1]["content"])
        if not parsed.any:
            if g.finish_reason == "length":  # cut off mid-turn, no call to run
                ep.end_reason = cut
                return
            if limits.answer_ends:
                ep.end_reason = ANSWERED
                return
        observations: list[dict] = []
        for call in parsed.calls:
            if call.name == "submit" and "submit" in offered:
                ep.calls["submit"] = ep.calls.get("submit", 0) + 1
                ep.submitted = dict(call.arguments)
                ep.end_reason = SUBMITTED
                return
            observations.append(_run_call(ctx, call, offered, runner, limits, ep))
        for error in parsed.errors:
            ep.malformed_calls += 1
            observations.append({"role": "tool", "content": f"error: {error}"})
        if not observations:
            observations = [{"role": "user", "content": "Continue."}]
        if not traj.add_messages(observations, limit=session.context_limit(
                limits.context_length)):
            ep.end_reason = CONTEXT
            return
    ep.end_reason = MAX_TURNS


def _run_call(ctx: JobContext, call: ToolCall, offered: set[str], runner: ToolRunner | None,
              limits: AgentLimits, ep: Episode) -> dict:
    ctx.check()
    if call.name not in offered or runner is None:
        ep.malformed_calls += 1
        return {"role": "tool", "content": f"error: unknown tool {call.name!r}; available: "
                                           f"{', '.join(sorted(offered))}"}
    ep.calls[call.name] = ep.calls.get(call.name, 0) + 1
    timeout = max(0.1, min(limits.call_timeout_s, ctx.remaining_s))
    t0 = time.monotonic()
    try:
        text, ok = runner.run(call.name, call.arguments, abort_hook=ctx.on_abort,
                              timeout_s=timeout)
    except BadArguments as e:
        ep.malformed_calls += 1
        text, ok = f"error: {e}", False
    finally:
        ep.tool_s += time.monotonic() - t0
    if not ok:
        ep.tool_errors += 1
    return {"role": "tool", "content": truncate(text, limits.observation_chars)}
