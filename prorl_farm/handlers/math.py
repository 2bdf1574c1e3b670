"""``math``: a problem, a reference answer, an optional Python tool; reward by math-verify.

RUN sees only the problem (the answer is EVAL-only). The policy may call ``python`` (an
IPython kernel in the job's sandbox) as often as the limits allow; a turn without a call is
its final answer. EVAL grades only that final message's last ``\\boxed{...}`` against the
reference with math-verify: an answer longer than ``max_answer_chars``, or several candidates
in one box where the reference is a single value, earns 0.
"""

from __future__ import annotations

import re

from marshmallow import fields, validate

from prorl_farm.handlers.agentic import AGENT_OPTIONS, AgentOptions, ToolAgentHandler, final_answer
from prorl_farm.handlers.base import JobContext

DEFAULT_PROMPT = ("Solve the problem. You may run Python with the python tool. Put the final "
                  "answer in \\boxed{{}}.\n\n{problem}")


class MathInstance(AgentOptions):
    problem = fields.String(required=True, validate=validate.Length(min=1, max=100_000))
    answer = fields.String(required=True, validate=validate.Length(min=1, max=1000))
    tools = fields.List(fields.String(validate=validate.OneOf(["python"])),
                        load_default=lambda: ["python"])
    prompt_template = fields.String(load_default=DEFAULT_PROMPT)
    max_answer_chars = fields.Integer(load_default=200, strict=True,
                                      validate=validate.Range(min=1, max=10_000))


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


class MathHandler(ToolAgentHandler):
    name = "math"
    description = ("Math problems with an optional Python tool; reward by math-verify on the "
                   "final \\boxed{} answer.")
    instance_schema = MathInstance
    visible_fields = ("problem", "prompt_template", *AGENT_OPTIONS)

    def run(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        return self.episode(ctx, inst["prompt_template"].format(problem=inst["problem"]))

    def eval(self, ctx: JobContext) -> dict:
        reward, why = grade(final_answer(ctx.result), ctx.instance["answer"],
                            ctx.instance["max_answer_chars"])
        return {"reward": reward, "verdict": why}
