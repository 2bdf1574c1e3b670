"""Run a repository task's named tests with pytest; the verdict is one line tagged with a
nonce that only this process knows.

Run as ``python3 -I grader/swe_harness.py`` in a fresh sandbox holding ``repo/`` (the tree
to test: the base commit with the agent's changes, protected files already restored from
the base) and ``grader/`` (``spec.json``, ``test.patch``, and ``model.patch`` in reference
mode). The nonce comes on stdin, read before anything of the repository is imported.

Order: import pytest (from the interpreter's own site, before the repository is on the
path, so a ``pytest.py`` in the repository shadows nothing); apply ``model.patch`` if any
(not applying: the candidate fails); run the instance's setup commands; apply the test
patch (not applying: an instance error); run pytest on the files of the named tests, keep
only the named tests, and record each one's outcome from pytest's own reports.

The repository's code runs in this process (the tests import it), so what it prints, and
an early exit, reach nothing: only the nonce-tagged line counts, and no line means no
verdict (reward 0). Exit status 0 and ``NONCE {"outcomes": {test: outcome}}``, or
``NONCE {"error": ...}`` when the instance or the environment is at fault, or
``NONCE {"applied": false, ...}`` when the candidate patch does not apply.
"""

import ctypes
import json
import os
import subprocess
import sys

PR_SET_DUMPABLE = 4


def main():
    nonce = sys.stdin.readline().strip()
    try:
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, no /proc/self/mem
    except (OSError, AttributeError):
        pass
    grader = os.path.abspath("grader")
    repo = os.path.abspath("repo")

    def verdict(**fields):
        sys.stdout.write(f"\n{nonce} {json.dumps(fields)}\n")
        sys.stdout.flush()
        os._exit(0)  # no atexit hook of the repository's runs after the verdict

    with open(os.path.join(grader, "spec.json")) as f:
        spec = json.load(f)
    try:
        import pytest
    except ImportError as e:
        verdict(error=f"pytest is not importable by {sys.executable} in the sandbox: {e}")

    def apply(name):
        out = subprocess.run(["git", "apply", "--whitespace=nowarn", "-p1",
                              os.path.join(grader, name)], cwd=repo, capture_output=True,
                             text=True, stdin=subprocess.DEVNULL)
        return out.returncode == 0, (out.stdout + out.stderr)[-2000:]

    if os.path.exists(os.path.join(grader, "model.patch")):
        ok, why = apply("model.patch")
        if not ok:
            verdict(applied=False, why=why)
    for command in spec.get("setup", []):
        out = subprocess.run(["bash", "--noprofile", "--norc", "-c", command], cwd=repo,
                             capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            verdict(error=f"setup command failed ({out.returncode}): {command}\n"
                          f"{(out.stdout + out.stderr)[-2000:]}")
    ok, why = apply("test.patch")
    if not ok:
        verdict(error=f"the test patch does not apply: {why}")

    wanted = list(dict.fromkeys(spec["tests"]))
    outcomes_wanted = set(wanted)
    outcomes = {}

    class Recorder:
        def pytest_collection_modifyitems(self, session, config, items):
            keep = [i for i in items if i.nodeid in outcomes_wanted]
            dropped = [i for i in items if i.nodeid not in outcomes_wanted]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = keep

        def pytest_runtest_logreport(self, report):
            name = report.nodeid
            if name not in outcomes_wanted:
                return
            if report.failed:
                outcomes[name] = "failed" if report.when == "call" else "error"
            elif report.skipped and name not in outcomes:
                outcomes[name] = "skipped"
            elif report.when == "call" and report.passed and name not in outcomes:
                outcomes[name] = "passed"

    files = [f for f in dict.fromkeys(t.split("::")[0] for t in wanted)
             if os.path.isfile(os.path.join(repo, f))]
    os.chdir(repo)
    sys.path.insert(0, repo)  # as `python -m pytest` from the repository's root would
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    if files:
        try:
            pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", repo, *files],
                        plugins=[Recorder()])
        except BaseException:  # noqa: BLE001 - what the tests raise is theirs
            pass
    verdict(outcomes={t: outcomes.get(t, "missing") for t in wanted})


if __name__ == "__main__":
    main()
