"""A SWE-bench row as a farm job: where its repository and environment come from, what its
sandbox holds, and how its grading is asked for and read.

A ``swe`` instance that names a ``version`` (and brings no ``setup`` commands or
``archive`` of its own) is a SWE-bench instance: it is graded the SWE-bench way, in the
environment SWE-bench's spec for its (repository, version) describes (``specs.json``, from
swebench 4.1.0, the last release with the tables), or it is refused with the reason: an
unknown version, a missing ``environment_setup_commit``, a repository source that does not
hold its commits. It is never graded in an environment SWE-bench would not have built (the
system's interpreter with nothing installed graded gold patches 0). Other instances (the
farm's own sample repository, instances with their own ``setup`` commands) keep the plain
``swe`` path.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
from dataclasses import dataclass

from prorl_farm.errors import InvalidInstance
from prorl_farm.swebench import repos, verdicts
from prorl_farm.swebench.envs import Env, EnvBuilder, EnvSpec, load_specs, spec_for

GRADER_DIR = ".prorl-grader"  # the grader's files in the grading sandbox (removed first)
# Repositories that are the test runner (or the plugin system under it): their tests are
# run by the candidate's own code, so no evidence is beyond its reach (SWE-bench reads the
# log that code writes). Graded, with the guard off and ``trust`` saying so.
RUNNER_REPOS = frozenset({"pytest-dev/pytest", "pytest-dev/pluggy"})
LOG_BYTES = 256 << 10


# The test runners whose evidence the farm's harness reads, by the program of a spec's
# ``test_cmd`` (after its environment assignments).
RUNNERS = {"pytest": "pytest", "./tests/runtests.py": "django", "bin/test": "sympy"}


# The files of a repository's own test runner (a path, or a directory ending in ``/``):
# never the candidate's (restored from the base, as conftest.py is), and an instance whose
# own fix is in them is refused (its runner would be the candidate's code).
RUNNER_FILES = {
    "django": ("tests/runtests.py", "tests/test_sqlite.py", "django/test/"),
    "sympy": ("bin/test", "bin/get_sympy.py", "sympy/testing/runtests.py",
              "sympy/utilities/runtests.py", "sympy/testing/pytest.py",
              "sympy/utilities/pytest.py"),
    "pytest": (),
}


def in_runner(path: str, runner: str) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p))
               for p in RUNNER_FILES.get(runner, ()))


def command_words(spec: EnvSpec) -> tuple[list[str], list[str]]:
    """A spec's test command as (its leading environment assignments, the program and its
    arguments)."""
    words = shlex.split(spec.test_cmd)
    n = 0
    while n < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[n]):
        n += 1
    return words[:n], words[n:]


def runner_of(spec: EnvSpec) -> str | None:
    """``pytest``, ``django`` or ``sympy``: how the harness runs ``spec``'s tests (None: a
    runner it does not read)."""
    words = command_words(spec)[1]
    return RUNNERS.get(words[0]) if words else None


def is_swebench(inst: dict) -> bool:
    """Whether ``inst`` asks to be graded as SWE-bench grades it: a ``version``, and no
    ``setup`` commands or ``archive`` of its own (an ``image`` of its own, where no spec
    of its repository exists, keeps the plain path)."""
    if inst.get("version") in (None, "") or inst.get("setup") or inst.get("archive"):
        return False
    return not (inst.get("image") and inst["repo"] not in load_specs()["specs"])


def _version_key(version: str) -> tuple:
    """Orders "4.3" before "5.0" before "v5.3" (astropy's specs hold both kinds)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in version.split("."))


def refusal(inst: dict) -> dict[str, list[str]]:
    """Why a SWE-bench instance cannot be graded as SWE-bench would, by field (``{}``: it
    can, or it is not one). Read from the row alone: said at submit time."""
    if not is_swebench(inst):
        return {}
    repo, version = inst["repo"], str(inst["version"])
    table = load_specs()["specs"].get(repo)
    if table is None:
        return {"repo": [f"no SWE-bench environment spec for {repo} (the farm has swebench "
                         f"4.1.0's, for {len(load_specs()['specs'])} repositories): give the "
                         "instance `setup` commands, or an `archive` or `image`, to grade it "
                         "on the plain swe path; or leave out `version`"]}
    spec = spec_for(repo, version)
    if spec is None:
        known = ", ".join(sorted(table, key=_version_key))
        return {"version": [f"{repo} has no SWE-bench environment spec for version "
                            f"{version!r} (swebench 4.1.0's specs know {known})"]}
    if spec.pre_install:
        return {"version": [f"{spec.name}: SWE-bench's spec runs pre-install commands as "
                            f"root in its image ({'; '.join(spec.pre_install)[:300]}), which "
                            "a farm node does not"]}
    if spec.packages.endswith((".yml", ".yaml")):
        return {"version": [f"{spec.name}: SWE-bench's spec builds a conda environment "
                            f"({spec.packages}), which the farm does not"]}
    if runner_of(spec) is None:
        return {"repo": [f"{spec.name}: its tests run with {spec.test_cmd!r}; the farm's "
                         f"harness reads the evidence of pytest's, Django's runtests.py's "
                         f"and sympy's bin/test's runs"]}
    runner = runner_of(spec)
    touched = sorted(p for p in _patch_files(inst.get("patch") or "") if in_runner(p, runner))
    if touched:
        return {"patch": [f"the fix changes the test runner's own files ({', '.join(touched)}):"
                          " the runner would be the candidate's code, which the farm's "
                          "harness does not trust to report"]}
    if not inst.get("environment_setup_commit"):
        return {"environment_setup_commit": [
            f"required for a SWE-bench instance ({repo} {version}): the commit SWE-bench "
            "builds the environment from, a field of every SWE-bench row; never taken to be "
            "the base commit"]}
    return {}


def published_rule() -> dict:
    """What :func:`refusal` asks of a SWE-bench instance, as OpenAPI 3.0 schema keywords for
    the instance: it is not one (no ``version``; ``setup`` or an ``archive``; an ``image``
    of a repository with no spec), or its repository and version are ones the farm grades
    as SWE-bench does, and it names its ``environment_setup_commit``. (A gold ``patch`` that
    changes the test runner's own files is refused too; no schema says that.)"""
    specs = load_specs()["specs"]
    gradable = {repo: sorted((v for v in table if not refusal(
        {"repo": repo, "version": v, "environment_setup_commit": "x"})), key=_version_key)
        for repo, table in sorted(specs.items())}
    nonempty = {"type": "string", "minLength": 1}
    not_swebench = [
        {"not": {"required": ["version"], "properties": {"version": nonempty}}},
        {"required": ["setup"], "properties": {"setup": {"type": "array", "minItems": 1}}},
        {"required": ["archive"], "properties": {"archive": nonempty}},
        {"required": ["image"], "properties": {"image": nonempty,
                                               "repo": {"not": {"enum": sorted(specs)}}}}]
    graded = {"required": ["repo", "version", "environment_setup_commit"], "properties": {
        "environment_setup_commit": nonempty}, "anyOf": [
        {"properties": {"repo": {"enum": [repo]}, "version": {"enum": versions}}}
        for repo, versions in gradable.items() if versions]}
    return {"anyOf": [*not_swebench, graded]}


def _patch_files(patch: str) -> set[str]:
    return {b for a, b in re.findall(r"^diff --git a/(\S+) b/(\S+)", patch, re.M)} | \
        {a for a, b in re.findall(r"^diff --git a/(\S+) b/(\S+)", patch, re.M)}


def swebench_spec(inst: dict) -> EnvSpec | None:
    """The environment spec that makes ``inst`` a SWE-bench instance; None for the plain
    path. A SWE-bench instance that cannot be graded as SWE-bench would raises
    :class:`InvalidInstance` with the reason (rows queued before a refusal was known)."""
    if not is_swebench(inst):
        return None
    why = refusal(inst)
    if why:
        raise InvalidInstance("; ".join(f"{field}: {' '.join(msgs)}"
                                        for field, msgs in why.items()), why)
    return spec_for(inst["repo"], inst["version"])


@dataclass
class Prepared:
    spec: EnvSpec
    git_dir: str
    base_commit: str
    env: Env
    source: str = ""  # where the repository came from

    @functools.cached_property
    def base(self) -> dict[str, bytes]:
        """The tree at the base commit (read when first asked for: INIT in reference mode
        needs only the environment)."""
        return repos.tree(self.git_dir, self.base_commit)

    @property
    def overlay(self) -> dict[str, bytes]:
        return self.env.overlay()

    def workspace(self, commit: str) -> dict[str, bytes]:
        """The agent's checkout: the base tree, what the environment's install wrote into
        it, and a ``.git`` holding only the base commit (its own id)."""
        return {**self.base, **self.overlay, **repos.workspace_git(self.git_dir, commit)}


def git_source(inst: dict, roots: list[str], cache: str) -> tuple[str, str]:
    """(the git directory, where it came from) holding the instance's ``base_commit`` and
    ``environment_setup_commit``: its ``repo_path`` (a git repository or a bundle under a
    mount root), else the first source of its repository under the mount roots, in their
    order, that holds both commits (a bundle or a repository of another snapshot under an
    earlier root does not hide the right one under a later root). The error says each
    source searched and what it lacked."""
    from prorl_farm.errors import SandboxError
    from prorl_farm.sandbox.manager import under_mount_roots

    wanted = {"base_commit": inst["base_commit"]}
    if inst.get("environment_setup_commit"):
        wanted["environment_setup_commit"] = inst["environment_setup_commit"]
    if inst.get("repo_path"):
        try:
            path = under_mount_roots(inst["repo_path"], roots, "repo_path")
        except SandboxError as e:
            raise InvalidInstance(str(e)) from e
        candidates = [(path, lambda p=path: repos.unpack_bundle(p, cache)
                       if os.path.isfile(p) else p)]
        rule = "repo_path"
    else:
        candidates = repos.sources(inst["repo"], roots, cache)
        rule = (f"{inst['repo'].replace('/', '__')}.bundle, then a git repository at "
                f"{inst['repo'].replace('/', '__')}, {inst['repo']} or "
                f"{inst['repo'].split('/', 1)[1]}, under each mount root in order "
                f"({', '.join(roots) or 'none set: PRORL_SANDBOX_MOUNT_ROOTS'})")
    searched = []
    for where, opened in candidates:
        try:
            git_dir = opened()
        except InvalidInstance as e:
            searched.append(f"{where} (unreadable: {str(e)[:200]})")
            continue
        lacks = [f"{field} {commit}" for field, commit in wanted.items()
                 if not repos.has_commit(git_dir, commit)]
        if not lacks:
            return git_dir, where
        searched.append(f"{where} (lacks {' and '.join(lacks)})")
    raise InvalidInstance(
        f"no source of {inst['repo']} holds " + " and ".join(
            f"{f} {c}" for f, c in wanted.items()) + f"; searched {rule}: "
        + ("; ".join(searched) if searched else "nothing found"),
        {"repo_path" if inst.get("repo_path") else "repo": searched or ["not found"]})


def prepare(inst: dict, spec: EnvSpec, settings, roots: list[str], log=lambda s: None
            ) -> Prepared:
    """The instance's repository (at its base commit) and environment (built if needed)."""
    cache = os.path.join(settings.swe_env_dir, ".repos")
    os.makedirs(cache, exist_ok=True)
    git_dir, where = git_source(inst, roots, cache)
    base = inst["base_commit"]
    setup = inst["environment_setup_commit"]
    builder = EnvBuilder(settings.swe_env_dir, settings.swe_pythons,
                         lock_dirs=lock_dirs(settings))
    env = builder.ensure(spec, lambda: repos.tree(git_dir, setup),
                         repos.full_commit(git_dir, setup), log,
                         base_files=lambda: repos.tree(git_dir, base),
                         base_commit=repos.full_commit(git_dir, base))
    return Prepared(spec, git_dir, base, env, where)


def lock_dirs(settings) -> tuple[str, ...]:
    """Where environment locks are looked for, in order: ``PRORL_SWE_LOCKS`` (a user's own,
    written by ``prorl-farm swebench lock``), then the package's."""
    return tuple(filter(None, [settings.swe_locks]))


def environment(prep: Prepared) -> dict:
    """What a job result says of the environment that graded it: its name, whether its
    packages were pinned by a lock, and (unpinned) what was installed."""
    m = prep.env.manifest
    detail = {"spec": f"swebench 4.1.0: {prep.spec.repo} {prep.spec.version}",
              "python": m.get("python_version"), "lock": m.get("lock_source"),
              "repository": prep.source}
    if not m.get("locked"):
        detail["installed"] = m.get("resolved", "")
    return {"environment": os.path.basename(prep.env.path), "pinned": bool(m.get("locked")),
            "environment_detail": detail}


def grading_spec(inst: dict, prep: Prepared, changed: set[str], test_paths: set[str],
                 protected: dict) -> dict:
    """The harness's spec for a SWE-bench run: SWE-bench's test directives, every test they
    run, the runner (pytest with the spec's options and the environment's plugins; Django's
    ``runtests.py`` or sympy's ``bin/test``, with their files protected)."""
    runner = runner_of(prep.spec)
    words = command_words(prep.spec)[1]
    return {"tests": verdicts.test_names(inst["FAIL_TO_PASS"])
            + verdicts.test_names(inst["PASS_TO_PASS"]),
            "files": verdicts.test_directives(inst["test_patch"], runner), "every_test": True,
            "kind": runner, "runner_args": words[1:],
            "protected_paths": list(RUNNER_FILES[runner]),
            "pytest_args": words[1:],
            "plugins": prep.env.manifest.get("plugins", []), "log_bytes": LOG_BYTES,
            "changed": sorted(changed - test_paths), "test_files": sorted(test_paths),
            "timeout_s": inst["test_timeout_s"], "guard": inst["repo"] not in RUNNER_REPOS,
            **protected}


def read_verdict(inst: dict, verdict: dict) -> dict:
    """The job's result from the harness's verdict, read as SWE-bench 5.0.2 would."""
    f2p = verdicts.test_names(inst["FAIL_TO_PASS"])
    p2p = verdicts.test_names(inst["PASS_TO_PASS"])
    decided = verdicts.verdict(verdict["outcomes"], verdict.get("exit_code"), f2p, p2p,
                              runner_of(spec_for(inst["repo"], inst["version"])))
    sm = decided["status_map"]

    def status(case):
        key = verdicts._resolve(case, sm)
        return sm[key] if key is not None else "MISSING"
    out = {"reward": 1.0 if decided["resolved"] else 0.0, "resolved": decided["resolved"],
           "tests": {"FAIL_TO_PASS": {t: status(t) for t in f2p},
                     "PASS_TO_PASS": {t: status(t) for t in p2p}},
           "log": verdicts.log_text(verdict.get("output", ""), verdict.get("exit_code")),
           "grading": f"swebench {verdicts.SWEBENCH_VERSION} semantics",
           "trust": ("candidate-runner: the repository is the test runner, whose reports come "
                     "from the candidate's code (as SWE-bench's log does)"
                     if inst["repo"] in RUNNER_REPOS else "evidence")}
    if not decided["valid"]:
        out["invalid"] = decided["why"]
    else:
        out["report"] = decided["tests"]
    return out
