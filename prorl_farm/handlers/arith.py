"""``arith``: single-digit addition, the task a tiny model learns by RL in a minute on a CPU.

The prompt is one user message ``a+b``; one assistant turn answers. The reward is 1 only
for the exact sum and then the end of the turn (the turn stopped on its end token, nothing
but the digits before it), else 0. No sandbox. It exists for the end-to-end RL loop
(``examples/grpo_cpu.py``) and as the smallest complete RL environment.
"""

from __future__ import annotations

from marshmallow import RAISE, Schema, fields, validate

from prorl_farm.agent.trajectory import Trajectory, load_chat_tokens
from prorl_farm.handlers.base import AgentHandler, JobContext
from prorl_farm.llm.session import BackendSession, turn_seed


class ArithInstance(Schema):
    class Meta:
        unknown = RAISE

    a = fields.Integer(required=True, strict=True, validate=validate.Range(min=0, max=9))
    b = fields.Integer(required=True, strict=True, validate=validate.Range(min=0, max=9))


def prompt_messages(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"{a}+{b}"}]


class ArithHandler(AgentHandler):
    name = "arith"
    description = "Single-digit addition; reward 1 for the exact sum, then the end of turn."
    instance_schema = ArithInstance
    # The answer is the sum of what the policy sees: nothing to hide.
    visible_fields = ("a", "b")

    def init(self, ctx: JobContext) -> dict:
        return {}

    def run(self, ctx: JobContext) -> dict:
        session = BackendSession.for_job(ctx)
        with session:
            _, chat = session.first_backend(load_chat_tokens)
            traj = Trajectory.start(chat,
                                    prompt_messages(ctx.instance["a"], ctx.instance["b"]))
            sent = traj.context()
            t = session.generate(sent, dict(ctx.sampling, seed=turn_seed(ctx, 0)))
            traj.add_turn(sent, t)
        out = traj.to_dict()
        out["failovers"] = session.failovers
        return out

    def reference(self, ctx: JobContext) -> dict:
        answer = str(ctx.instance["a"] + ctx.instance["b"])
        return {"messages": [*prompt_messages(ctx.instance["a"], ctx.instance["b"]),
                             {"role": "assistant", "content": answer}],
                "turns": [{"finish_reason": "stop"}]}

    def eval(self, ctx: JobContext) -> dict:
        want = str(ctx.instance["a"] + ctx.instance["b"])
        turns = ctx.result.get("turns") or []
        answer = next((m["content"] for m in reversed(ctx.result["messages"])
                       if m["role"] == "assistant"), None)
        # "stop": the turn ended on its end token (decoded text has special tokens skipped,
        # so anything else the policy wrote shows in the answer).
        ok = bool(turns) and turns[-1].get("finish_reason") == "stop" and answer == want
        return {"reward": 1.0 if ok else 0.0, "answer": answer, "expected": want}
