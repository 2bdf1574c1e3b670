"""``chat``: a multi-turn conversation with the policy, token-in/token-out.

An instance gives the opening messages and, optionally, scripted observations: after each
assistant turn the next observation is appended (as a user or tool message) and the policy
answers again. EVAL rewards 1.0 when the final answer contains ``answer``. No sandbox: the
handler exists to run exact multi-turn trajectories against LLM backends (math, chat RL,
and the farm's own tests and benchmarks).
"""

from __future__ import annotations

from marshmallow import RAISE, Schema, fields, validate

from prorl_farm.agent.loop import CONTEXT_LENGTH
from prorl_farm.agent.trajectory import Trajectory, load_chat_tokens
from prorl_farm.handlers.base import AgentHandler, JobContext
from prorl_farm.llm.backends.abstract import MAX_TOKENS
from prorl_farm.llm.session import BackendSession, turn_seed


class Message(Schema):
    class Meta:
        unknown = RAISE

    role = fields.String(required=True, validate=validate.OneOf(
        ["system", "user", "assistant", "tool"]))
    content = fields.String(required=True)


class ChatInstance(Schema):
    class Meta:
        unknown = RAISE

    messages = fields.List(fields.Nested(Message), required=True,
                           validate=validate.Length(min=1))
    observations = fields.List(fields.String(), load_default=list)
    observation_role = fields.String(load_default="user",
                                     validate=validate.OneOf(["user", "tool"]))
    answer = fields.String(load_default=None, allow_none=True)
    max_turns = fields.Integer(load_default=None, allow_none=True, strict=True,
                               validate=validate.Range(min=1, max=1000))
    # A turn cut off at max_tokens ends the episode unless this is set; then the template's
    # glue closes the turn (mask 0) and the conversation goes on.
    continue_on_length = fields.Boolean(load_default=False)


class ChatHandler(AgentHandler):
    name = "chat"
    description = "Multi-turn chat with scripted observations; reward 1 if the answer appears."
    instance_schema = ChatInstance

    def init(self, ctx: JobContext) -> dict:
        return {}

    def run(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        session = BackendSession.for_job(ctx)
        with session:
            first, chat = session.first_backend(load_chat_tokens)
            traj = Trajectory.start(chat, inst["messages"])
            observations = inst.get("observations") or []
            max_turns = inst.get("max_turns") or len(observations) + 1
            requested = int(ctx.sampling.get("context_length") or CONTEXT_LENGTH)
            end = "turns"
            for turn in range(max_turns):
                sent = traj.context()
                # A turn that would not fit the engine's context ends the conversation.
                room = session.room(requested, len(sent), first_turn=turn == 0)
                if room <= 0:
                    end = "context"
                    break
                wanted = int(ctx.sampling.get("max_tokens") or MAX_TOKENS)
                sampling = dict(ctx.sampling, seed=turn_seed(ctx, turn),
                                max_tokens=min(wanted, room))
                t = session.generate(sent, sampling)
                g = t.generation
                traj.add_turn(sent, t)
                stopped = g.finish_reason == "stop" or (
                    g.finish_reason == "length" and inst.get("continue_on_length"))
                if not stopped:
                    end = "length"
                if turn >= len(observations) or not stopped or turn + 1 == max_turns:
                    break
                if not traj.add_messages([{"role": inst["observation_role"],
                                           "content": observations[turn]}],
                                         limit=session.context_limit(requested)):
                    end = "context"
                    break
        out = traj.to_dict()
        out["failovers"] = session.failovers
        out["stats"] = {"end_reason": end, "turns": len(traj.turns)}
        return out

    def eval(self, ctx: JobContext) -> dict:
        answer = ctx.instance.get("answer")
        final = next((m["content"] for m in reversed(ctx.result["messages"])
                      if m["role"] == "assistant"), "")
        return {"reward": 1.0 if answer and answer.strip() in final else 0.0}
