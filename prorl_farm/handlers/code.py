"""``code``: a statement and hidden tests; the policy writes a Python program.

Tests come in one of two styles: stdin/stdout pairs (Codeforces/TACO/APPS), or test code
with an entry point (HumanEval's ``check(candidate)``, or MBPP's list of asserts). RUN sees
the statement only; it may try things with the ``python`` tool, and its final program is the
one it ``submit``s (``{"code": ...}``) or, failing that, the last ```python block of its final
answer. EVAL runs that program against the tests in a fresh sandbox holding only the program,
the tests and the farm's harness (``prorl_farm/graders/code_harness.py``), with per-test time
and memory limits; the program never runs in the harness's process, so printing fake
results, exiting early or patching ``assert`` earns nothing. Reward 1 only if every test
passes; the pass fraction is kept.
"""

from __future__ import annotations

import json
import logging
import re
import secrets

from marshmallow import RAISE, Schema, ValidationError, fields, validate, validates_schema

from prorl_farm.errors import InvalidInstance
from prorl_farm.graders import source
from prorl_farm.graders.code_harness import WALL_FACTOR
from prorl_farm.handlers.agentic import (
    AGENT_OPTIONS,
    AgentOptions,
    ToolAgentHandler,
    final_answer,
    no_answer,
)
from prorl_farm.handlers.base import JobContext
from prorl_farm.sandbox import warm_graders
from prorl_farm.sandbox.isolated import GRADER_LIMITS, jail_spec, required_verdict, run_isolated

log = logging.getLogger(__name__)

DEFAULT_PROMPT = ("Write a Python program for the task below. You may try code with the python "
                  "tool. When done, call submit with your complete program as \"code\" (or give "
                  "it in a final ```python block).\n\n{statement}")
HARNESS_PROMPT = ("Write a Python program for the task below. Give your complete program in "
                  "a final ```python block.\n\n{statement}")


# How a stdio test's output is judged: the same words however spaced (the default), the same
# lines, numbers within a tolerance, or the task's own checker program (a special judge).
CHECKERS = ("tokens", "exact", "floats", "program")


class StdioTest(Schema):
    class Meta:
        unknown = RAISE

    input = fields.String(required=True)
    output = fields.String(required=True)


class CodeInstance(AgentOptions):
    statement = fields.String(required=True, validate=validate.Length(min=1, max=200_000))
    tests = fields.List(fields.Nested(StdioTest), validate=validate.Length(min=1, max=1000))
    test_code = fields.String(validate=validate.Length(min=1, max=1_000_000))
    test_list = fields.List(fields.String(), validate=validate.Length(min=1, max=1000))
    test_setup = fields.String(load_default="")
    entry_point = fields.String(validate=validate.Regexp(r"^[A-Za-z_][A-Za-z0-9_]*$"))
    canonical_solution = fields.String(load_default=None, allow_none=True)
    time_limit_s = fields.Float(load_default=5.0, validate=validate.Range(min=0.1, max=600))
    memory_mb = fields.Integer(load_default=512, strict=True,
                               validate=validate.Range(min=16, max=65_536))
    tools = fields.List(fields.String(validate=validate.OneOf(["python", "bash"])),
                        load_default=lambda: ["python"])
    prompt_template = fields.String(load_default=DEFAULT_PROMPT)
    checker = fields.String(load_default="tokens", validate=validate.OneOf(CHECKERS))
    float_tolerance = fields.Float(load_default=1e-6, validate=validate.Range(min=0, max=1))
    checker_program = fields.String(validate=validate.Length(min=1, max=200_000))

    @validates_schema
    def _checker(self, data, **_):
        if data.get("checker") == "program" and "checker_program" not in data:
            raise ValidationError("required with checker 'program'", "checker_program")
        if "checker_program" in data and data.get("checker") != "program":
            raise ValidationError("only with checker 'program'", "checker_program")
        if data.get("checker", "tokens") != "tokens" and "tests" not in data:
            raise ValidationError("a checker judges stdin/stdout 'tests' only", "checker")

    @validates_schema
    def _one_style(self, data, **_):
        stdio = "tests" in data
        calls = "test_code" in data or "test_list" in data
        if stdio == calls:
            raise ValidationError("give stdin/stdout 'tests', or 'test_code'/'test_list' with "
                                  "an 'entry_point'", "tests")
        if calls and "entry_point" not in data:
            raise ValidationError("required with test_code/test_list", "entry_point")


_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def final_program(result: dict) -> str | None:
    """The submitted program, or the last ```python block of the final answer."""
    submitted = (result.get("submitted") or {})
    if isinstance(submitted.get("code"), str) and submitted["code"].strip():
        return submitted["code"]
    blocks = _BLOCK.findall(final_answer(result))
    return blocks[-1] if blocks else None


def tests_spec(inst: dict) -> dict:
    """What the harness needs of an instance's tests. ``time_limit_s`` is the program's CPU
    time per test (per call in the call style), however busy the machine; a program that
    waits rather than computes is stopped at ``WALL_FACTOR`` times it of wall clock."""
    spec = {"time_s": inst["time_limit_s"], "wall_s": WALL_FACTOR * inst["time_limit_s"],
            "memory_mb": inst["memory_mb"]}
    if inst.get("tests"):
        # float_tolerance: absolute or relative, as competitive programming's checkers take it
        checker = {"kind": inst.get("checker", "tokens"),
                   "tolerance": inst.get("float_tolerance", 1e-6)}
        if checker["kind"] == "program":
            checker["program"] = inst["checker_program"]
        return {**spec, "style": "stdio", "tests": inst["tests"], "checker": checker}
    cases = inst.get("test_list") or [inst["test_code"]]
    return {**spec, "style": "call", "entry_point": inst["entry_point"], "cases": cases,
            "setup": inst.get("test_setup", "")}


# The sandbox runtimes whose graders' jail this process has seen work: a grading there skips
# the harness's probe of the jail (a bubblewrap start and its confinement stage, about a
# fifth of a call-style grading); one that then finds the jail broken is an error (not a run
# without it), and the next grading probes again.
_JAIL_SEEN: set[str] = set()


def grade_program(ctx: JobContext, program: str, inst: dict) -> dict:
    """Run the harness on ``program`` in a fresh sandbox: the tests reach it on its stdin,
    never as a file, and its verdict is the line tagged with a nonce it read there."""
    nonce = secrets.token_hex(16)
    runtime = ctx.sandboxes.runtime.name
    spec = {**tests_spec(inst), "nonce": nonce, **jail_spec(ctx),
            "jail_seen": runtime in _JAIL_SEEN}
    n = len(spec.get("tests") or spec.get("cases"))
    # Each test within its wall-clock backstop, and the harness's own start and jail.
    timeout_s = max(0.1, min(n * (spec["wall_s"] + 5) + 60, ctx.remaining_s))
    out = None
    settings = getattr(ctx, "settings", None)
    if spec["jail_seen"] and settings is not None and settings.warm_graders:
        try:  # a warm grader of the job's tenant: no sandbox start, the same jail
            out = warm_graders.graders(settings.grader_idle_s).grade(
                ctx, {"code_harness.py": source("code_harness.py")}, spec, program,
                timeout_s, GRADER_LIMITS)
        except warm_graders.Unavailable as e:
            log.warning("grading in a fresh sandbox: %s", e)
    if out is None:
        files = {"solution.py": program, "code_harness.py": source("code_harness.py")}
        out = run_isolated(ctx, files, ["python3", "-I", "-S", "code_harness.py"],
                           timeout_s=timeout_s, stdin=json.dumps(spec))
    try:
        verdict = required_verdict(out, nonce, "code harness")
    except Exception:
        _JAIL_SEEN.discard(runtime)
        raise
    if verdict.get("jail") == "bwrap":
        _JAIL_SEEN.add(runtime)
    fraction = verdict["passed"] / verdict["total"] if verdict["total"] else 0.0
    return {"reward": 1.0 if verdict["passed"] == verdict["total"] > 0 else 0.0,
            "pass_fraction": round(fraction, 6), "jail": verdict.get("jail"),
            "tests": verdict["results"][:100], "harness_mb": verdict.get("memory_mb")}


class CodeHandler(ToolAgentHandler):
    name = "code"
    description = ("Programming tasks with hidden tests (stdin/stdout or assert-based); reward "
                   "1 if the final program passes them all, in a fresh sandbox.")
    instance_schema = CodeInstance
    instance_constraints = {"oneOf": [
        {"required": ["tests"],
         "not": {"anyOf": [{"required": ["test_code"]}, {"required": ["test_list"]}]}},
        {"required": ["entry_point"], "not": {"required": ["tests"]},
         "anyOf": [{"required": ["test_code"]}, {"required": ["test_list"]}]},
    ], "allOf": [  # a checker judges stdio tests; "program" comes with its program. In
        # OpenAPI 3.0's schema (no if/then, no const): "if A then B" is "not A, or B".
        {"anyOf": [{"not": {"required": ["checker"],
                            "properties": {"checker": {"enum": ["program"]}}}},
                   {"required": ["checker_program"]}]},
        {"anyOf": [{"not": {"required": ["checker_program"]}},
                   {"required": ["checker"], "properties": {"checker": {"enum": ["program"]}}}]},
        {"anyOf": [{"not": {"required": ["checker"],
                            "properties": {"checker": {"not": {"enum": ["tokens"]}}}}},
                   {"required": ["tests"]}]},
    ]}
    visible_fields = ("statement", "prompt_template", "time_limit_s", "memory_mb",
                      "entry_point", *AGENT_OPTIONS)
    extra_tools = ("submit",)

    def reference(self, ctx: JobContext) -> dict:
        solution = ctx.instance.get("canonical_solution")
        if not solution:
            raise InvalidInstance("no canonical_solution to validate")
        return {"submitted": {"code": solution}, "stats": {"end_reason": "submitted"}}

    def run(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        return self.episode(ctx, inst["prompt_template"].format(statement=inst["statement"]),
                            HARNESS_PROMPT.format(statement=inst["statement"]))

    def eval(self, ctx: JobContext) -> dict:
        if ctx.state.get("sandbox"):
            ctx.sandboxes.stop(ctx.state["sandbox"])  # its slot is free for the grader's
        program = final_program(ctx.result or {})
        if program is None:
            return {"reward": 0.0, "pass_fraction": 0.0,
                    "verdict": no_answer(ctx.result, "no program")}
        return grade_program(ctx, program, ctx.instance)
