"""``math``: a problem, a reference answer, an optional Python tool; reward by math-verify.

RUN sees only the problem (the answer is EVAL-only). The policy may call ``python`` (an
IPython kernel in the job's sandbox) as often as the limits allow; a turn without a call is
its final answer. EVAL grades only that final message's last ``\\boxed{...}`` against the
reference with math-verify: an answer longer than ``max_answer_chars``, or several candidates
in one box where the reference is a single value, earns 0.
"""

from __future__ import annotations

import re

from marshmallow import RAISE, Schema, fields, validate

from prorl_farm.agent.loop import AgentLimits, run_episode
from prorl_farm.agent.parsers import PARSERS, get_parser
from prorl_farm.agent.tools import ToolRunner
from prorl_farm.handlers.base import AgentHandler, JobContext
from prorl_farm.sandbox.abstract import SandboxSpec
from prorl_farm.sandbox.client import ToolClient

DEFAULT_PROMPT = ("Solve the problem. You may run Python with the python tool. Put the final "
                  "answer in \\boxed{{}}.\n\n{problem}")


class MathInstance(Schema):
    class Meta:
        unknown = RAISE

    problem = fields.String(required=True, validate=validate.Length(min=1, max=100_000))
    answer = fields.String(required=True, validate=validate.Length(min=1, max=1000))
    tools = fields.List(fields.String(validate=validate.OneOf(["python"])),
                        load_default=lambda: ["python"])
    system = fields.String(load_default=None, allow_none=True)
    prompt_template = fields.String(load_default=DEFAULT_PROMPT)
    parser = fields.String(load_default="hermes", validate=validate.OneOf(sorted(PARSERS)))
    max_turns = fields.Integer(load_default=None, allow_none=True, strict=True,
                               validate=validate.Range(min=1, max=1000))
    max_answer_chars = fields.Integer(load_default=200, strict=True,
                                      validate=validate.Range(min=1, max=10_000))
    call_timeout_s = fields.Float(load_default=None, allow_none=True,
                                  validate=validate.Range(min=0.1, max=3600))


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = text.find("{", start)
        if i == -1:
            return None
        depth, j = 0, i
        while j < len(text):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1:j].strip()
            j += 1
        start = text.rfind("\\boxed", 0, start)
    return None


_SEPARATORS = re.compile(r",|;|\bor\b|\\text\{\s*or\s*\}|\\lor")


def grade(final_text: str, reference: str, max_chars: int = 200) -> tuple[float, str]:
    """(reward, why) for a final message against the reference."""
    from math_verify import parse, verify

    answer = last_boxed(final_text)
    if answer is None:
        return 0.0, "no \\boxed{} answer"
    if len(answer) > max_chars:
        return 0.0, f"answer longer than {max_chars} characters"
    single = not _SEPARATORS.search(reference)
    if single and _SEPARATORS.search(answer):
        return 0.0, "several candidate answers"
    # Stage threads cannot use math-verify's signal-based timeouts; the length bound above
    # keeps the parse small.
    gold = _parse(parse, reference)
    pred = _parse(parse, answer)
    if not gold or not pred:
        return 0.0, "answer could not be parsed"
    ok = verify(gold, pred, timeout_seconds=None)
    return (1.0, "correct") if ok else (0.0, "wrong")


def _parse(parse, text: str):
    return (parse(f"${text}$", parsing_timeout=None)
            or parse(text, parsing_timeout=None))


class MathHandler(AgentHandler):
    name = "math"
    description = ("Math problems with an optional Python tool; reward by math-verify on the "
                   "final \\boxed{} answer.")
    instance_schema = MathInstance
    visible_fields = ("problem", "tools", "system", "prompt_template", "parser", "max_turns",
                      "call_timeout_s")

    def reference(self, ctx: JobContext) -> dict:
        answer = ctx.instance["answer"]
        return {"messages": [{"role": "assistant", "content": f"\\boxed{{{answer}}}"}],
                "stats": {"end_reason": "answered"}}

    def init(self, ctx: JobContext) -> dict:
        if not ctx.instance["tools"] or ctx.mode == "reference":
            return {}
        sandbox = ctx.sandboxes.start(SandboxSpec(), ctx.job_id, ctx.requeues, ctx)
        return {"sandbox": sandbox.to_dict()}

    def run(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        messages = ([{"role": "system", "content": inst["system"]}] if inst["system"] else [])
        messages.append({"role": "user",
                         "content": inst["prompt_template"].format(problem=inst["problem"])})
        limits = AgentLimits.from_job(inst, ctx.sampling)
        client = ToolClient(ctx.state["sandbox"]["socket"]) if ctx.state.get("sandbox") \
            else None
        try:
            runner = ToolRunner(client, limits.call_timeout_s) if client else None
            traj, ep = run_episode(ctx, messages, inst["tools"], get_parser(inst["parser"]),
                                   limits, runner)
        finally:
            if client is not None:
                client.close()
        return {**traj.to_dict(), "stats": ep.stats()}

    def eval(self, ctx: JobContext) -> dict:
        result = ctx.result or {}
        final = ""
        if result.get("stats", {}).get("end_reason") == "answered":
            final = next((m["content"] for m in reversed(result.get("messages", []))
                          if m["role"] == "assistant"), "")
        reward, why = grade(final, ctx.instance["answer"], ctx.instance["max_answer_chars"])
        return {"reward": reward, "verdict": why}
