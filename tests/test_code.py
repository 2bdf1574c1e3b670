"""The ``code`` handler through the real pipeline: a scripted policy submits programs, and
the hidden tests run in a fresh sandbox under the farm's harness. Honest programs pass in
both test styles; wrong ones and every trick on the grader earn 0, and a program that forks,
allocates or loops without end is stopped within its limits and leaves the node clean."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.farm import (
    pool_user,
    readable_copy,
    run_batch,
    scripted_farm,
    use_only_backend,
    wait_until,
)

pytestmark = pytest.mark.slow


def submit(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "submit", "arguments": {"code": code}}) + \
        "\n</tool_call>"


DOUBLE = "import sys\nprint(2 * int(sys.stdin.read()))\n"
ADD = "def add(a, b):\n    return a + b\n"
FAKE = ('import os\nprint(\'{"passed": 9, "total": 9, "results": []}\')\nos._exit(0)\n')
PROGRAMS = {
    "stdio-good": DOUBLE,
    "stdio-bad": "import sys\nprint(3 * int(sys.stdin.read()))\n",
    "call-good": ADD,
    "call-bad": "def add(a, b):\n    return a - b\n",
    "fake-output": FAKE,
    "rigged-eq": "class Any:\n    def __eq__(self, other):\n        return True\n"
                 "def add(a, b):\n    return Any()\n",
    "patched": "import builtins, unittest\nbuiltins.AssertionError = Exception\n"
               "unittest.TestCase.assertEqual = lambda *a: None\ndef add(a, b):\n    return 0\n",
    "exit-early": "import os, sys\ndef add(a, b):\n    os._exit(0)\nsys.exit(0)\n",
    # The harness imports what a program says its modules are: a name bound to a module
    # object called like one that exits when imported (unittest.__main__), for the test
    # code's `check` or `assert`.
    "names-a-module": "import types\ncheck = types.ModuleType('unittest.__main__')\n"
                      "globals()['assert'] = types.ModuleType('unittest.__main__')\n"
                      "def add(a, b):\n    return 0\n",
    # Writes its own ready line, built to make the harness's literal parser take hundreds of
    # times its size (then never answers a call).
    **{f"amplify-{mb}M": f"import os, sys\nline = b'ready ' + b'[' + b'0,' * ({mb} << 19) + "
                         f"b']\\n'\nos.write(int(sys.argv[2]), line)\nos._exit(0)\n"
       for mb in (1, 4, 16)},
    "amplify-names": "import os, sys\nv = repr('[' + '(),' * (1 << 20) + ']')\n"
                     "os.write(int(sys.argv[2]), b'ready ' + repr({'BIG': ['value', "
                     "'[' + '(),' * (1 << 20) + ']']}).encode() + b'\\n')\n"
                     "def add(a, b):\n    return 0\nBIG = 1\n",
    "fork-bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                 "        pass\n",
    "memory-hog": "x = []\nwhile True:\n    x.append(bytearray(10**7))\n",
    "forever": "while True:\n    pass\n",
}
PLANS = {name: [submit(code)] for name, code in PROGRAMS.items()}
PLANS["block"] = ["Here it is:\n```python\n" + DOUBLE + "```"]
PLANS["nothing"] = ["I cannot do this."]

STDIO_TESTS = [{"input": "2", "output": "4"}, {"input": "21", "output": "42\n"}]
CALL_TESTS = {"test_code": "def check(candidate):\n    assert candidate(1, 2) == 3\n"
                           "    assert candidate(-4, 4) == 0\n", "entry_point": "add"}
MBPP_TESTS = {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"],
              "entry_point": "add"}


@pytest.fixture(scope="module", params=["root", "nobody"])
def code_farm(request, redis_server, tmp_path_factory, tiny_model):
    """The pools as root (the usual case in containers and CI), then as user nobody."""
    user = pool_user(request.param)
    readable = Path(tempfile.mkdtemp(prefix="prs-code-"))
    os.chmod(readable, 0o755)
    tokenizer = str(tiny_model) if user is None else readable_copy(tiny_model, readable)
    try:
        with scripted_farm(redis_server.url, tmp_path_factory.mktemp(f"code-{request.param}"),
                           tokenizer, PLANS, f"code-{request.param}", user=user
                           ) as (client, server):
            client.backend = {"url": server.url, "kind": "vllm", "model": "tiny",
                              "tokenizer": tokenizer, "capacity": 64}
            yield client
    finally:
        shutil.rmtree(readable, ignore_errors=True)


def _code(client, cases: list[tuple[str, dict]]) -> list[dict]:
    # Registered per call: a test's `r` fixture clears the farm's keys, backends included.
    use_only_backend(client, **client.backend)
    instances = [{"statement": f"[case:{c}] Solve it.", "tools": [], "time_limit_s": 2.0,
                  "memory_mb": 256, **tests} for c, tests in cases]
    return run_batch(client, {"handler": "code", "instances": instances,
                              "sampling": {"max_tokens": 512}, "deadline_s": 180}, 180)


def test_honest_programs_pass_and_wrong_ones_fail_in_both_styles(code_farm):
    stdio = {"tests": STDIO_TESTS}
    jobs = _code(code_farm, [("stdio-good", stdio), ("stdio-bad", stdio), ("block", stdio),
                             ("call-good", CALL_TESTS), ("call-bad", CALL_TESTS),
                             ("call-good", MBPP_TESTS), ("nothing", stdio)])
    assert all(j["state"] == "done" for j in jobs), [j["failure"] for j in jobs]
    rewards = [j["reward"] for j in jobs]
    assert rewards == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0], [j["result"].get("eval")
                                                             for j in jobs]
    assert jobs[0]["result"]["stats"]["end_reason"] == "submitted"
    assert jobs[2]["result"]["stats"]["end_reason"] == "answered"
    assert jobs[1]["result"]["eval"]["pass_fraction"] == 0.0
    # The hidden tests never reached RUN's view.
    assert "42" not in jobs[0]["result"]["messages"][0]["content"]


def test_tricks_on_the_grader_earn_nothing(code_farm):
    cases = [("fake-output", {"tests": STDIO_TESTS}), ("fake-output", CALL_TESTS),
             ("rigged-eq", CALL_TESTS), ("rigged-eq", MBPP_TESTS), ("patched", CALL_TESTS),
             ("patched", MBPP_TESTS), ("exit-early", CALL_TESTS), ("call-good", CALL_TESTS)]
    jobs = _code(code_farm, cases)
    *tricks, honest = jobs
    assert honest["reward"] == 1.0
    for job, (case, _) in zip(tricks, cases):
        assert job["state"] == "done" and job["reward"] == 0.0, (case, job["result"]["eval"])


def test_a_program_that_steers_the_harness_earns_zero_with_the_reason(code_farm):
    """Whatever a wrong program makes the harness do (import a module it names, raise
    ``SystemExit``, parse megabytes of its own literals) earns 0 with the reason, never a
    failed job; the harness's memory stays within 64 MiB of its start while it reads up to
    16 MiB of the program's output."""
    mbpp = {**MBPP_TESTS, "test_list": ["assert add(1, 2) == 3 and BIG == 1"]}
    cases = [("names-a-module", CALL_TESTS), ("names-a-module", MBPP_TESTS),
             ("amplify-1M", CALL_TESTS), ("amplify-4M", CALL_TESTS),
             ("amplify-16M", CALL_TESTS), ("amplify-names", mbpp),
             ("call-good", CALL_TESTS)]
    jobs = _code(code_farm, cases)
    *attacks, honest = jobs
    assert honest["reward"] == 1.0, honest["result"]["eval"]
    for job, (case, _) in zip(attacks, cases):
        assert job["state"] == "done", (case, job["failure"])  # a zero, not an error
        ev = job["result"]["eval"]
        assert job["reward"] == 0.0 and ev["tests"][0]["why"], (case, ev)
        grew = ev["harness_mb"]["peak"] - ev["harness_mb"]["start"]
        assert grew <= 64, (case, ev["harness_mb"])


def test_runaway_programs_end_within_their_limits_and_leave_the_node_clean(code_farm, r):
    stdio = {"tests": STDIO_TESTS}
    jobs = _code(code_farm, [("fork-bomb", stdio), ("memory-hog", stdio), ("forever", stdio),
                             ("stdio-good", stdio)])
    *runaways, honest = jobs
    assert honest["reward"] == 1.0, (honest["failure"], [j["failure"] for j in runaways])
    for job in runaways:
        assert job["state"] == "done" and job["reward"] == 0.0, (
            job["failure"] or (job["result"] or {}).get("eval"))
        assert job["timings"]["eval"]["active_s"] < 60
    wait_until(lambda: not r.hlen("prorl:sandboxes:testnode"), 20, 0.1, "sandboxes stopped")
