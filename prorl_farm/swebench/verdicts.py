"""SWE-bench's verdict, decided from the farm's evidence.

The farm does not parse a test log to grade: a log is written by the process that runs the
candidate's code, and whatever that code prints is in it. The hardened runner sends, test
by test, what pytest reported and whether the farm's own wrapper saw the call return; those
outcomes are then read **as SWE-bench 5.0.2 reads its log** (``swebench/harness/grading.py``
and the pytest log parser):

- a test's name is what the parser keeps of a ``-rA`` summary line: the node id up to its
  first blank (so ``test_fix[select a from b]`` is known as ``test_fix[select``); where
  several tests share that name, the one whose summary category pytest prints last wins
  (failed after errors after xpassed after xfailed after skipped after passed);
- an xpassed test has no status (the parser knows none for it);
- a FAIL_TO_PASS test succeeds if PASSED or XFAIL, and fails if absent, FAILED, ERROR or
  SKIPPED; a PASS_TO_PASS test is also kept by SKIPPED; a name truncated inside its
  parameters (more ``[`` than ``]``) matches the names it begins when they agree on pass or
  fail;
- resolved only if every FAIL_TO_PASS and every PASS_TO_PASS test succeeds;
- no status at all, or a run that ended with a non-zero status while no test failed, is
  *invalid* (SWE-bench: the patch "did not apply"/no log): never a plain 0.

Pinned to swebench 5.0.2: 4.x reads a skipped FAIL_TO_PASS test as neither success nor
failure, and an empty status map as resolved for some instances; the suite compares this
module with swebench 5.0.2's own functions on every shipped instance.
"""

from __future__ import annotations

import json
import re

SWEBENCH_VERSION = "5.0.2"
START = ">>>>> Start Test Output"
END = ">>>>> End Test Output"
EXIT_CODE = ">>>>> Test Exit Code"
PASSING = ("PASSED", "XFAIL")
# The order of pytest's short test summary under -rA (later categories overwrite earlier
# ones in the parser's map).
SUMMARY_ORDER = {"PASSED": 0, "SKIPPED": 1, "XFAIL": 2, "XPASS": 3, "ERROR": 4, "FAILED": 5}
# The farm's outcome -> the status word SWE-bench's parser for the runner's log would have
# read (none: the parser reads no status for that outcome). Django's parser reads
# unittest's verbose lines ("... ok", "... skipped", "... FAIL", "... ERROR"; an expected
# failure or an unexpected success has no status); sympy's reads bin/test's (" ok", " F",
# " E"; a skip, an XFAIL and an XPASS have none).
STATUS = {"passed": "PASSED", "failed": "FAILED", "error": "ERROR", "skipped": "SKIPPED",
          "xfail": "XFAIL", "xpass": "XPASS"}
STATUS_BY_RUNNER = {
    "pytest": STATUS,
    "django": {"passed": "PASSED", "failed": "FAILED", "error": "ERROR", "skipped": "SKIPPED"},
    "sympy": {"passed": "PASSED", "failed": "FAILED", "error": "ERROR"},
}


def test_names(value) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as SWE-bench stores them (a JSON string) or as lists."""
    return json.loads(value) if isinstance(value, str) else list(value or [])


def log_name(nodeid: str) -> str:
    """The name SWE-bench's pytest parser keeps for ``nodeid``."""
    parts = nodeid.split()
    return parts[0] if parts else nodeid


def status_map(outcomes: dict[str, str], runner: str = "pytest") -> dict[str, str]:
    """``{test: farm outcome}`` (in run order) -> SWE-bench's ``{name: status}``. pytest's
    tests are node ids (named as its parser names them); Django's and sympy's are already
    the names their parsers read (a test's description, a test function's name)."""
    if runner != "pytest":
        words = STATUS_BY_RUNNER[runner]
        return {name: words[o] for name, o in outcomes.items() if o in words}
    chosen: dict[str, tuple[int, int, str]] = {}
    for order, (nodeid, outcome) in enumerate(outcomes.items()):
        status = STATUS.get(outcome)
        if status is None:  # missing: no line in the log
            continue
        name = log_name(nodeid)
        rank = (SUMMARY_ORDER[status], order)
        if name not in chosen or rank > chosen[name][:2]:
            chosen[name] = (*rank, status)
    return {name: status for name, (_, _, status) in chosen.items() if status != "XPASS"}


def _resolve(case: str, sm: dict[str, str]) -> str | None:
    if case in sm:
        return case
    if case.count("[") > case.count("]"):
        matches = [k for k in sm if k.startswith(case)]
        if matches and len({sm[k] in PASSING for k in matches}) == 1:
            return matches[0]
    return None


def _passed(case: str, sm: dict[str, str]) -> bool:
    key = _resolve(case, sm)
    return key is not None and sm[key] in PASSING


def _failed(case: str, sm: dict[str, str]) -> bool:
    key = _resolve(case, sm)
    return key is None or sm[key] in ("FAILED", "ERROR", "SKIPPED")


def _maintained(case: str, sm: dict[str, str]) -> bool:
    key = _resolve(case, sm)
    return _passed(case, sm) or (key is not None and sm[key] == "SKIPPED")


def report(sm: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str]) -> dict:
    """SWE-bench's ``tests_status``: success and failure lists of each kind."""
    out = {"FAIL_TO_PASS": {"success": [], "failure": []},
           "PASS_TO_PASS": {"success": [], "failure": []}}
    for case in fail_to_pass:
        if _passed(case, sm):
            out["FAIL_TO_PASS"]["success"].append(case)
        elif _failed(case, sm):
            out["FAIL_TO_PASS"]["failure"].append(case)
    for case in pass_to_pass:
        if _maintained(case, sm):
            out["PASS_TO_PASS"]["success"].append(case)
        elif _failed(case, sm):
            out["PASS_TO_PASS"]["failure"].append(case)
    return out


def resolved(tests: dict) -> bool:
    def ratio(kind):
        total = len(tests[kind]["success"]) + len(tests[kind]["failure"])
        return 1 if total == 0 else len(tests[kind]["success"]) / total
    return ratio("FAIL_TO_PASS") == 1 and ratio("PASS_TO_PASS") == 1


def verdict(outcomes: dict[str, str], exit_code: int | None, fail_to_pass: list[str],
            pass_to_pass: list[str], runner: str = "pytest") -> dict:
    """``{"valid", "resolved", "tests", "status_map", "why"}`` from the farm's outcomes."""
    sm = status_map(outcomes, runner)
    if not sm:
        return {"valid": False, "resolved": False, "status_map": sm,
                "why": "no test ran (no status for any test)"}
    if exit_code not in (None, 0) and not any(s in ("FAILED", "ERROR") for s in sm.values()):
        return {"valid": False, "resolved": False, "status_map": sm,
                "why": f"the test run ended with status {exit_code} and no test failed"}
    tests = report(sm, fail_to_pass, pass_to_pass)
    return {"valid": True, "resolved": resolved(tests), "tests": tests, "status_map": sm,
            "why": None}


def test_files(test_patch: str) -> list[str]:
    """The files SWE-bench's test directives name: every file the test patch names
    (``diff --git a/X b/Y``: Y), but documentation and data files."""
    non_test = (".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml",
                ".yaml", ".toml")
    return [d for d in re.findall(r"diff --git a/.* b/(.*)", test_patch)
            if not any(d.endswith(ext) for ext in non_test)]


def test_directives(test_patch: str, runner: str = "pytest") -> list[str]:
    """SWE-bench's test directives (``get_test_directives``): the files of
    :func:`test_files`; for Django's ``runtests.py``, each as the module label it takes
    (``tests/a/b.py`` -> ``a.b``)."""
    files = test_files(test_patch)
    if runner != "django":
        return files
    out = []
    for d in files:
        d = d[:-len(".py")] if d.endswith(".py") else d
        d = d[len("tests/"):] if d.startswith("tests/") else d
        out.append(d.replace("/", "."))
    return out


def reset_files(test_patch: str) -> list[str]:
    """The files SWE-bench resets to the base commit around the tests
    (``get_modified_files``): each file the test patch changes or renames, as it was before
    (a new file has none)."""
    out = []
    for block in re.split(r"^(?=diff --git )", test_patch, flags=re.M):
        head = re.match(r"diff --git a/(\S+) b/(\S+)", block)
        if head and not re.search(r"^(new file mode|--- /dev/null)", block, re.M):
            out.append(head.group(1))
    return out


def eval_script(instance: dict, test_cmd: str, repo_dir: str = "/workspace",
                runner: str = "pytest") -> list[str]:
    """What the farm's grader does for ``instance``, written as the commands of SWE-bench's
    eval script (``make_eval_script_list_py``), for comparison with SWE-bench's builder. The
    farm runs them as its hardened harness does (not through a shell): the tests in-process
    under the evidence runner, whose outcomes are read as :func:`verdict` says."""
    files = " ".join(test_directives(instance["test_patch"], runner))
    reset = " ".join(reset_files(instance["test_patch"]))
    base = instance["base_commit"]
    return [f"cd {repo_dir}",
            f"git checkout {base} {reset}",
            "git apply -v - <<'EOF_114329324912'\n" + instance["test_patch"]
            + "\nEOF_114329324912",
            f": '{START}'",
            f"{test_cmd} {files}",
            f": '{END}'",
            f"git checkout {base} {reset}"]


def log_text(output: str, exit_code: int | None) -> str:
    """The runner's output in the frame of SWE-bench's eval log (markers, exit status)."""
    return (f"+ : '{START}'\n{output}\n+ : '{END}'\n"
            f"{EXIT_CODE}: {exit_code if exit_code is not None else -1}\n")
