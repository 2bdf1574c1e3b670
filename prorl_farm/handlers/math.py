"""``math``: a problem, a reference answer, an optional Python tool; reward by math-verify.

RUN sees only the problem (the answer is EVAL-only). The policy may call ``python`` (an
IPython kernel in the job's sandbox) as often as the limits allow; a turn without a call is
its final answer. EVAL grades only that final message's last ``\\boxed{...}`` (or, where
the task says ``answer_format: final``, its last unboxed final-answer line of a common
convention) against the reference with math-verify, after the answer's dress is read
(choice letters, intervals, repeating decimals, words, bases, angles). A hedge (another
value offered after the box, a relation between different values, a percent for a number),
an answer longer than ``max_answer_chars``, or several candidates in one box where the
reference is a single value, earns 0. Grading runs in a helper process under time and
memory bounds (:mod:`prorl_farm.graders.answers`), never in the pool: an answer that
exceeds them earns 0 with the reason.
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

DEFAULT_PROMPT = ("Solve the problem. You may run Python with the python tool. Put the final "
                  "answer in \\boxed{{}}.\n\n{problem}")
# What an agent harness gets: no word of the built-in loop's tools (it has its own).
HARNESS_PROMPT = "Solve the problem. Put the final answer in \\boxed{{}}.\n\n{problem}"


class MathInstance(AgentOptions):
    problem = fields.String(required=True, validate=validate.Length(min=1, max=100_000))
    answer = fields.String(required=True, validate=validate.Length(min=1, max=1000))
    tools = fields.List(fields.String(validate=validate.OneOf(["python"])),
                        load_default=lambda: ["python"])
    prompt_template = fields.String(load_default=DEFAULT_PROMPT)
    max_answer_chars = fields.Integer(load_default=200, strict=True,
                                      validate=validate.Range(min=1, max=10_000))
    answer_format = answers.answer_format_field()


class MathHandler(ToolAgentHandler):
    name = "math"
    description = ("Math problems with an optional Python tool; reward by math-verify on the "
                   "final \\boxed{} answer.")
    instance_schema = MathInstance
    visible_fields = ("problem", "prompt_template", *AGENT_OPTIONS)

    def run(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        template = inst["prompt_template"]
        return self.episode(ctx, template.format(problem=inst["problem"]),
                            (HARNESS_PROMPT if template == DEFAULT_PROMPT else template)
                            .format(problem=inst["problem"]))

    def eval(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        reward, why = answers.grade_for(ctx, {
            "kind": "math", "text": final_answer(ctx.result), "reference": inst["answer"],
            "max_chars": inst["max_answer_chars"], "answer_format": inst["answer_format"]})
        return {"reward": reward, "verdict": no_answer(ctx.result, why)}
