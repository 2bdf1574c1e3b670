"""``stem``: a science/engineering question with a reference that is a choice letter, a
number or an expression.

RUN sees the question (and the choices, if any), never the reference; tools are optional
(none by default). The final answer is the last ``\\boxed{...}`` of the final message, or,
for multiple choice, a line ``Answer: X``. A choice question is graded by exact letter (one
letter only: "A or B" earns 0); anything else by math-verify, with the same bounds as
``math`` (answer length, one candidate).
"""

from __future__ import annotations

import re

from marshmallow import fields, validate

from prorl_farm.handlers.agentic import AGENT_OPTIONS, AgentOptions, ToolAgentHandler, final_answer
from prorl_farm.handlers.base import JobContext
from prorl_farm.handlers.math import grade, last_boxed

CHOICE_PROMPT = ("Answer the question. Give the letter of the correct choice as \\boxed{{X}}."
                 "\n\n{question}\n\n{choices}")
OPEN_PROMPT = "Answer the question. Put the final answer in \\boxed{{}}.\n\n{question}"


class StemInstance(AgentOptions):
    question = fields.String(required=True, validate=validate.Length(min=1, max=100_000))
    choices = fields.List(fields.String(), validate=validate.Length(min=2, max=26))
    answer = fields.String(required=True, validate=validate.Length(min=1, max=1000))
    tools = fields.List(fields.String(validate=validate.OneOf(["python"])), load_default=list)
    max_answer_chars = fields.Integer(load_default=200, strict=True,
                                      validate=validate.Range(min=1, max=10_000))


_ANSWER_LINE = re.compile(r"(?im)^\s*answer\s*[:：]\s*\(?([A-Z])\)?\s*$")


def grade_choice(final_text: str, reference: str, n_choices: int) -> tuple[float, str]:
    picked = last_boxed(final_text)
    if picked is None:
        lines = _ANSWER_LINE.findall(final_text)
        picked = lines[-1] if lines else None
    if picked is None:
        return 0.0, "no answer"
    letter = picked.strip().strip("()").strip()
    valid = {chr(ord("A") + i) for i in range(n_choices)}
    if letter.upper() not in valid or len(letter) != 1:
        return 0.0, "not a single choice letter"
    return (1.0, "correct") if letter.upper() == reference.strip().upper() else (0.0, "wrong")


class StemHandler(ToolAgentHandler):
    name = "stem"
    description = ("STEM questions: a choice letter, a number or an expression; exact choice "
                   "or math-verify.")
    instance_schema = StemInstance
    visible_fields = ("question", "choices", *AGENT_OPTIONS)

    def run(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        if inst.get("choices"):
            listed = "\n".join(f"{chr(ord('A') + i)}. {c}" for i, c in enumerate(inst["choices"]))
            text = CHOICE_PROMPT.format(question=inst["question"], choices=listed)
        else:
            text = OPEN_PROMPT.format(question=inst["question"])
        return self.episode(ctx, text)

    def eval(self, ctx: JobContext) -> dict:
        inst, final = ctx.instance, final_answer(ctx.result)
        if inst.get("choices"):
            reward, why = grade_choice(final, inst["answer"], len(inst["choices"]))
        else:
            reward, why = grade(final, inst["answer"], inst["max_answer_chars"])
        return {"reward": reward, "verdict": why}
