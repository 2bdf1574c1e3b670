"""``stem``: a science/engineering question with a reference that is a choice letter, a
number or an expression.

RUN sees the question (and the choices, if any), never the reference; tools are optional
(none by default). The final answer is the last ``\\boxed{...}`` of the final message, or,
for multiple choice, a line ``Answer: X``. A choice question is graded by exact letter (one
letter only: "A or B" earns 0); anything else by math-verify, with the same bounds as
``math`` (answer length, one candidate).
"""

from __future__ import annotations

from marshmallow import fields, validate

from prorl_farm.graders import answers
from prorl_farm.handlers.agentic import (
    AGENT_OPTIONS,
    AgentOptions,
    ToolAgentHandler,
    final_answer,
    no_answer,
)
from prorl_farm.handlers.base import JobContext

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
    answer_format = answers.answer_format_field()


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
        inst = ctx.instance
        request = {"text": final_answer(ctx.result), "reference": inst["answer"]}
        if inst.get("choices"):
            request.update(kind="choice", n_choices=len(inst["choices"]))
        else:
            request.update(kind="math", max_chars=inst["max_answer_chars"],
                           answer_format=inst["answer_format"])
        reward, why = answers.grade_for(ctx, request)
        return {"reward": reward, "verdict": no_answer(ctx.result, why)}
