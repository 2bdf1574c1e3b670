"""The ``swe`` handler through the real pipeline, on the sample repository of
``examples/swe/build.py``: a scripted policy fixes the bug with editor calls (resolved, reward
1) or leaves it (0); every trick on the grader (editing the tests, a conftest.py or a test
configuration that forces passes, a printed fake verdict with an early exit, a ``pytest.py``
shadowing the real one) earns 0; the repository's later history, the test patch and the
host's copy of the repository are out of the agent's sight; and reference mode grades the
gold patches. Run with the pools as root and as an unprivileged user."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.farm import (
    ROOT,
    needs_bwrap_and_git,
    pool_user,
    readable_copy,
    run_batch,
    scripted_farm,
    use_only_backend,
    wait_until,
)

pytestmark = needs_bwrap_and_git()


def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + \
        "\n</tool_call>"


def _edit(command: str, path: str, **args) -> str:
    return _call("str_replace_editor", command=command, path=path, **args)


SUBMIT = _call("submit")
FORCE_PASS = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
              "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
              "    outcome.get_result().outcome = 'passed'\n")
FAKE = ('import os\nprint(\'{"outcomes": {"tests/test_calc.py::test_mul": "passed", '
        '"tests/test_calc.py::test_add": "passed"}}\')\nos._exit(0)\n')
PLANS = {
    "good": [_edit("view", "calc/__init__.py"),
             _edit("str_replace", "calc/__init__.py", old_str="result += b",
                   new_str="result += a"), SUBMIT],
    "bad": [_call("bash", command="cat calc/__init__.py"), SUBMIT],
    "edit-tests": [_edit("create", "tests/test_calc.py",
                         file_text="def test_add():\n    pass\n\n\ndef test_mul():\n    pass\n"),
                   SUBMIT],
    "conftest": [_edit("create", "conftest.py", file_text=FORCE_PASS), SUBMIT],
    "config": [_edit("create", "calc/plugin.py", file_text=FORCE_PASS),
               _edit("str_replace", "setup.cfg", old_str="testpaths = tests",
                     new_str="testpaths = tests\naddopts = -p calc.plugin"), SUBMIT],
    "fake-verdict": [_edit("insert", "calc/__init__.py", insert_line=0, new_str=FAKE), SUBMIT],
    "shadow-pytest": [_edit("create", "pytest.py",
                            file_text="def main(*args, **kwargs):\n    return 0\n"), SUBMIT],
    # /opt/prorl is the farm's own tree (its virtual environment: gigabytes with vLLM), no task data
    "look": [_call("bash", command="git log --all --format=%s; cat {repo}/calc/__init__.py; "
                   "grep -rlF 'mul(2, 3) == 6' . /tmp /srv $(ls -d /opt/* | grep -vx /opt/prorl) "
                   "2>/dev/null; echo looked"), SUBMIT],
}


def build_repos(dest: Path) -> list[dict]:
    spec = importlib.util.spec_from_file_location("swe_build", ROOT / "examples/swe/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(dest)


@pytest.fixture(scope="module", params=["root", "nobody"])
def swe_farm(request, redis_server, tmp_path_factory, tiny_model):
    user = pool_user(request.param)
    repos = Path(tempfile.mkdtemp(prefix="prs-swe-repos-"))
    os.chmod(repos, 0o755)
    instances = build_repos(repos)
    repo = repos / "prorl__calc"
    plans = {k: [t.replace("{repo}", str(repo)) for t in v] for k, v in PLANS.items()}
    tokenizer = str(tiny_model)
    if user is not None:  # the tokenizer where the RUN pool's user can read it
        tokenizer = readable_copy(tiny_model, repos)
    try:
        with scripted_farm(redis_server.url, tmp_path_factory.mktemp(f"swe-{request.param}"),
                           str(tokenizer), plans, f"swe-{request.param}", user=user,
                           sandbox_mount_roots=str(repos)) as (client, server):
            client.backend = {"url": server.url, "kind": "vllm", "model": "tiny",
                              "tokenizer": str(tokenizer), "capacity": 64}
            yield client, instances, repo
    finally:
        shutil.rmtree(repos, ignore_errors=True)


def _swe(client, instances: list[dict], mode: str = "policy", max_tokens: int = 1024,
         deadline_s: float = 240) -> list[dict]:
    """One batch of ``swe`` jobs on the client's scripted backend, to its end."""
    use_only_backend(client, **client.backend)
    body = {"handler": "swe", "instances": instances, "sampling": {"max_tokens": max_tokens},
            "deadline_s": deadline_s}
    if mode != "policy":
        body["mode"] = mode
    return run_batch(client, body, deadline_s)


def _case(instance: dict, case: str) -> dict:
    return {**instance, "problem_statement": f"[case:{case}] {instance['problem_statement']}",
            "test_timeout_s": 60}


def test_a_fix_resolves_and_no_fix_does_not(swe_farm, r):
    client, instances, _ = swe_farm
    good, bad = _swe(client, [_case(instances[0], "good"), _case(instances[0], "bad")])
    assert good["state"] == "done" and bad["state"] == "done", (good["failure"], bad["failure"])
    assert good["reward"] == 1.0, str({k: v for k, v in good["result"]["eval"].items()
                                       if k != "diff"})
    ev = good["result"]["eval"]
    assert ev["resolved"] and ev["tests"] == {
        "FAIL_TO_PASS": {"tests/test_calc.py::test_mul": "passed"},
        "PASS_TO_PASS": {"tests/test_calc.py::test_add": "passed"}}
    assert "-        result += b\n+        result += a\n" in ev["diff"]
    assert good["result"]["stats"]["end_reason"] == "submitted"
    assert bad["reward"] == 0.0 and bad["result"]["eval"]["tests"]["FAIL_TO_PASS"] == {
        "tests/test_calc.py::test_mul": "failed"}
    assert bad["result"]["eval"]["diff"] == ""
    # RUN never saw the tests, the gold patch or the test names.
    prompt = good["result"]["messages"][0]["content"]
    assert "test_mul" not in prompt and "result += a" not in prompt
    wait_until(lambda: not r.hlen("prorl:sandboxes:testnode"), 20, 0.1, "sandboxes stopped")


def test_tricks_on_the_grader_earn_nothing(swe_farm, r):
    client, instances, _ = swe_farm
    tricks = ["edit-tests", "conftest", "config", "fake-verdict", "shadow-pytest"]
    # The screen off: what is checked here is the test run's own defences. (With the screen
    # on, the printed verdict's early exit is flagged before any test runs.)
    jobs = _swe(client, [{**_case(instances[0], c), "screen": False}
                         for c in [*tricks, "good"]] + [_case(instances[0], "fake-verdict")])
    *tricked, honest, screened = jobs
    assert screened["reward"] == 0.0 and screened["result"]["eval"]["suspicious"] is True
    assert "screened out" in screened["result"]["eval"]["verdict"]
    assert "os._exit" in screened["result"]["eval"]["verdict"]
    assert honest["reward"] == 1.0, honest["result"].get("eval")
    for job, case in zip(tricked, tricks):
        assert job["state"] == "done" and job["reward"] == 0.0, (case, job["result"]["eval"])
    discarded = {case: job["result"]["eval"]["discarded"] for job, case in zip(tricked, tricks)}
    assert discarded["edit-tests"] == ["tests/test_calc.py"]
    assert discarded["conftest"] == ["conftest.py"]
    assert discarded["config"] == ["setup.cfg"]
    # The printed verdict and early exit: the harness, not the test process, decides.
    assert tricked[3]["result"]["eval"]["tests"]["FAIL_TO_PASS"] == {
        "tests/test_calc.py::test_mul": "missing"}
    assert tricked[4]["result"]["eval"]["tests"]["FAIL_TO_PASS"] == {
        "tests/test_calc.py::test_mul": "failed"}


def test_the_fix_history_and_the_host_repository_are_out_of_sight(swe_farm):
    client, instances, _ = swe_farm
    (job,) = _swe(client, [_case(instances[0], "look")])
    assert job["state"] == "done" and job["reward"] == 0.0
    seen = next(m["content"] for m in job["result"]["messages"] if m["role"] == "tool")
    assert seen.split("\n")[0].strip() == "base", seen  # one commit: the base, made afresh
    assert "Fix mul" not in seen and "result += a" not in seen, seen
    assert "No such file" in seen and seen.split("looked")[0].rstrip().endswith("directory"), seen


def test_reference_mode_grades_the_gold_patches(swe_farm):
    client, instances, _ = swe_farm
    wrong_fix = {**instances[0], "patch": instances[1]["patch"]}  # fixes the other bug
    no_apply = {**instances[0], "patch": instances[0]["patch"].replace("result += b",
                                                                       "result -= b")}
    jobs = _swe(client, [*instances, wrong_fix, no_apply], mode="reference")
    assert [j["reward"] for j in jobs] == [1.0, 1.0, 0.0, 0.0], [j["result"] for j in jobs]
    assert "does not apply" in jobs[3]["result"]["eval"]["verdict"]


def test_the_sample_dataset_names_the_built_repository(tmp_path):
    built = build_repos(tmp_path)
    shipped = [json.loads(line) for line in
               (ROOT / "examples/data/swe.jsonl").read_text().splitlines() if line.strip()]
    assert built == shipped


def test_bad_instances_are_refused_or_fail_never_score(swe_farm):
    client, instances, _ = swe_farm
    resp = client.post("/v1/jobs", json={"handler": "swe", "instance": {
        **instances[0], "base_commit": "--output=/tmp/x", "FAIL_TO_PASS": "not json"}})
    assert resp.status_code == 400
    fields = resp.get_json()["error"]["details"]["instances"]["0"]
    assert set(fields) == {"base_commit", "FAIL_TO_PASS"}, fields
    # A repository outside the operator's mount roots: the job fails, it is not graded.
    (job,) = _swe(client, [{**_case(instances[0], "good"), "repo_path": "/etc"}])
    assert job["state"] == "failed" and job["failure"]["kind"] == "invalid_instance", job
    assert job["reward"] is None


def _harness_functions() -> dict:
    """swe_harness.py's functions, as the grader ships them (no main run)."""
    from prorl_farm.graders import source

    namespace = {"__name__": "swe_harness"}
    exec(compile(source("swe_harness.py"), "swe_harness.py", "exec"), namespace)  # noqa: S102
    return namespace


WITNESS_TESTS = '''import pytest

def test_ok():
    pass

def test_bad():
    assert 1 == 2

@pytest.mark.xfail
def test_expected():
    assert 0

@pytest.mark.xfail
def test_lucky():
    pass

@pytest.mark.skip
def test_skipped():
    pass

@pytest.mark.parametrize("x", ["a b", "a c"])
def test_spaced(x):
    assert x == "a b"
'''


def test_pytests_own_report_is_a_second_witness(tmp_path):
    """The harness reads pytest's -rA summary as SWE-bench's log parser reads a log: on a
    real run it agrees with honest records test by test (nothing changed, nothing flagged);
    records that say a failing test passed are not a pass and are a contradiction, as is a
    report that says passed where the records do not; a test the report does not name is
    not a pass."""
    import subprocess

    h = _harness_functions()
    (tmp_path / "test_w.py").write_text(WITNESS_TESTS)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                          *h["with_summary"](["-q"]), "test_w.py"], cwd=tmp_path,
                         capture_output=True)
    report, rest = {}, b""
    for i in range(0, len(out.stdout), 7):  # in pieces, as the pipe hands them over
        rest = h["read_report"](rest + out.stdout[i:i + 7], report)
    h["read_report"](rest + b"\n", report)
    assert report["test_w.py::test_ok"] == "PASSED"
    assert report["test_w.py::test_bad"] == "FAILED"
    assert report["test_w.py::test_expected"] == "XFAIL"
    assert report["test_w.py::test_lucky"] == "XPASS"
    honest = {"test_w.py::test_ok": "passed", "test_w.py::test_bad": "failed",
              "test_w.py::test_expected": "xfail", "test_w.py::test_lucky": "xpass",
              "test_w.py::test_skipped": "skipped", "test_w.py::test_spaced[a b]": "passed",
              "test_w.py::test_spaced[a c]": "failed"}
    assert h["witnessed"](honest, report) == (honest, [])
    # Where the records do not tell expected failures apart (the plain `swe` run).
    plain = {**honest, "test_w.py::test_expected": "skipped",
             "test_w.py::test_lucky": "passed"}
    assert h["witnessed"](plain, report) == (plain, [])
    forged = {**honest, "test_w.py::test_bad": "passed"}
    outcomes, contradicted = h["witnessed"](forged, report)
    assert outcomes["test_w.py::test_bad"] == "failed"
    assert contradicted == [("test_w.py::test_bad", "FAILED")]
    outcomes, contradicted = h["witnessed"]({**honest, "test_w.py::test_ok": "failed"},
                                            report)
    assert contradicted == [("test_w.py::test_ok", "PASSED")]
    unnamed = {k: v for k, v in report.items() if k != "test_w.py::test_ok"}
    outcomes, contradicted = h["witnessed"](honest, unnamed)
    assert outcomes["test_w.py::test_ok"] == "missing" and contradicted == []


def _runner_builders() -> dict:
    """The runner's builders, without running it (its text, less the final ``main()``)."""
    from prorl_farm.graders import source

    text = source("swe_runner.py")
    assert text.rstrip().endswith("main()")
    space: dict = {}
    exec(compile(text.rstrip()[:-len("main()")], "<runner>", "exec"), space)
    return space


@pytest.mark.parametrize("expr,left,right,asked", [
    # the test's own ANY, in the place it wrote it: not asked
    ("{'v': 6, 'at': ANY}", {"v": 6, "at": 1}, {"v": 6, "at": "ANY"}, False),
    ("[0, mock.ANY]", [0, "x"], [0, "ANY"], False),
    # an object of anyone's elsewhere on the same side: asked
    ("{'v': EXPECTED, 'at': ANY}", {"v": 9, "at": 1}, {"v": "ANY", "at": "ANY"}, True),
    ("EXPECTED", 9, "ANY", True),
    ("expected", 9, "ANY", False),  # a local bound once to ANY
])
def test_the_probe_asks_every_object_but_the_tests_own_any(expr, left, right, asked):
    """The equality probe's masks: built from the assert's syntax, they spare only the
    places where the test wrote ANY; mock.ANY anywhere else is asked, and lies."""
    import ast
    from unittest import mock

    space = _runner_builders()
    fn = ast.parse(f"def test_x():\n    expected = ANY\n    assert got == {expr}\n").body[0]
    mask = space["owned_sides"](fn, ast)(fn.body[1].test.comparators[0])

    def swap(value):  # "ANY" in the case's values stands for mock.ANY
        if value == "ANY":
            return mock.ANY
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    caught = []

    def emit(kind, **fields):
        caught.append(fields)
        raise SystemExit  # where the runner ends itself

    probe = space["equality_probe"](emit, [])
    with pytest.raises(SystemExit) if asked else contextlib.nullcontext():
        assert probe.asserted(swap(left), swap(right), (False, mask))
    assert bool(caught) is asked, caught
