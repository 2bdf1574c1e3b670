"""A SWE-bench row as a farm job: where its repository and environment come from, what its
sandbox holds, and how its grading is asked for and read.

A ``swe`` instance is graded the SWE-bench way when it names a ``version`` for which the
farm has an environment spec (``specs.json``, from swebench 4.1.0); other instances (the
farm's own sample repository, instances with their own ``setup`` commands) keep the plain
``swe`` path.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from prorl_farm.errors import InvalidInstance
from prorl_farm.swebench import grading, repos
from prorl_farm.swebench.envs import Env, EnvBuilder, EnvSpec, spec_for

GRADER_DIR = ".prorl-grader"  # the grader's files in the grading sandbox (removed first)
# Repositories that are the test runner (or the plugin system under it): their tests are
# run by the candidate's own code, so no evidence is beyond its reach (SWE-bench reads the
# log that code writes). Graded, with the guard off and ``trust`` saying so.
RUNNER_REPOS = frozenset({"pytest-dev/pytest", "pytest-dev/pluggy"})
LOG_BYTES = 256 << 10


def swebench_spec(inst: dict) -> EnvSpec | None:
    """The environment spec that makes ``inst`` a SWE-bench instance, or None."""
    if inst.get("version") in (None, "") or inst.get("setup") or inst.get("archive"):
        return None
    return spec_for(inst["repo"], inst["version"])


@dataclass
class Prepared:
    spec: EnvSpec
    git_dir: str
    base: dict[str, bytes]
    env: Env

    @property
    def overlay(self) -> dict[str, bytes]:
        return self.env.overlay()

    def workspace(self, commit: str) -> dict[str, bytes]:
        """The agent's checkout: the base tree, what the environment's install wrote into
        it, and a ``.git`` holding only the base commit (its own id)."""
        return {**self.base, **self.overlay, **repos.workspace_git(self.git_dir, commit)}


def git_source(inst: dict, roots: list[str], cache: str) -> str:
    from prorl_farm.errors import SandboxError
    from prorl_farm.sandbox.manager import under_mount_roots

    if inst.get("repo_path"):
        try:
            path = under_mount_roots(inst["repo_path"], roots, "repo_path")
        except SandboxError as e:
            raise InvalidInstance(str(e)) from e
        return repos.unpack_bundle(path, cache) if os.path.isfile(path) else path
    found = repos.find_source(inst["repo"], roots, cache)
    if found is None:
        raise InvalidInstance(f"repository {inst['repo']} not found under the mount roots "
                              f"({', '.join(roots) or 'none set: PRORL_SANDBOX_MOUNT_ROOTS'})"
                              f": a git bundle {inst['repo'].replace('/', '__')}.bundle or a "
                              "git repository")
    return found


def prepare(inst: dict, spec: EnvSpec, settings, roots: list[str], log=lambda s: None
            ) -> Prepared:
    """The instance's repository (at its base commit) and environment (built if needed)."""
    if not spec.test_cmd.split()[:1] == ["pytest"]:
        raise InvalidInstance(f"{spec.repo} {spec.version}: its tests run with "
                              f"{spec.test_cmd!r}; the farm grades pytest-run repositories")
    cache = os.path.join(settings.swe_env_dir, ".repos")
    os.makedirs(cache, exist_ok=True)
    git_dir = git_source(inst, roots, cache)
    base = inst["base_commit"]
    if not repos.has_commit(git_dir, base):
        raise InvalidInstance(f"base_commit {base} is not in the repository source of "
                              f"{inst['repo']}")
    setup = inst.get("environment_setup_commit") or base
    if not repos.has_commit(git_dir, setup):
        setup = base
    base_files = repos.tree(git_dir, base)
    env = EnvBuilder(settings.swe_env_dir, settings.swe_pythons).ensure(
        spec, repos.tree(git_dir, setup), repos.full_commit(git_dir, setup), log,
        base_files=base_files, base_commit=repos.full_commit(git_dir, base))
    return Prepared(spec, git_dir, base_files, env)


def grading_spec(inst: dict, prep: Prepared, changed: set[str], test_paths: set[str],
                 protected: dict) -> dict:
    """The harness's spec for a SWE-bench run: SWE-bench's test files, every test in them,
    the spec's pytest options, the environment's plugins."""
    return {"tests": grading.test_names(inst["FAIL_TO_PASS"])
            + grading.test_names(inst["PASS_TO_PASS"]),
            "files": grading.test_files(inst["test_patch"]), "every_test": True,
            "pytest_args": shlex.split(prep.spec.test_cmd)[1:],
            "plugins": prep.env.manifest.get("plugins", []), "log_bytes": LOG_BYTES,
            "changed": sorted(changed - test_paths), "test_files": sorted(test_paths),
            "timeout_s": inst["test_timeout_s"], "guard": inst["repo"] not in RUNNER_REPOS,
            **protected}


def read_verdict(inst: dict, verdict: dict) -> dict:
    """The job's result from the harness's verdict, read as SWE-bench 5.0.2 would."""
    f2p = grading.test_names(inst["FAIL_TO_PASS"])
    p2p = grading.test_names(inst["PASS_TO_PASS"])
    decided = grading.verdict(verdict["outcomes"], verdict.get("exit_code"), f2p, p2p)
    sm = decided["status_map"]

    def status(case):
        key = grading._resolve(case, sm)
        return sm[key] if key is not None else "MISSING"
    out = {"reward": 1.0 if decided["resolved"] else 0.0, "resolved": decided["resolved"],
           "tests": {"FAIL_TO_PASS": {t: status(t) for t in f2p},
                     "PASS_TO_PASS": {t: status(t) for t in p2p}},
           "log": grading.log_text(verdict.get("output", ""), verdict.get("exit_code")),
           "grading": f"swebench {grading.SWEBENCH_VERSION} semantics",
           "trust": ("candidate-runner: the repository is the test runner, whose reports come "
                     "from the candidate's code (as SWE-bench's log does)"
                     if inst["repo"] in RUNNER_REPOS else "evidence")}
    if not decided["valid"]:
        out["invalid"] = decided["why"]
    else:
        out["report"] = decided["tests"]
    return out
