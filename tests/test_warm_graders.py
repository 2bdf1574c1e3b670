"""Warm graders (prorl_farm/sandbox/warm_graders.py): a grading sandbox that serves problem
after problem shares nothing of one grading with the next but the harness it forks from.
Each test grades through ``grade_program`` as EVAL does, with a real sandbox manager."""

from __future__ import annotations

import json
import os
import shutil
import threading
import types

import pytest

from prorl_farm import keys
from prorl_farm.context import JobContext
from prorl_farm.errors import JobAborted
from prorl_farm.graders import source
from prorl_farm.handlers.code import CodeInstance, grade_program
from prorl_farm.sandbox import warm_graders
from prorl_farm.sandbox.isolated import GRADER_LIMITS
from prorl_farm.sandbox.manager import SandboxManager
from tests.farm import wait_until

pytestmark = pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")

NODE = "warm-grading-node"

# The program of the first problem: looks for the grader's socket (or any) where a program
# can see, leaves a mark in its /tmp, and says what it found.
PRYING = '''
import os
def f():
    found = []
    for top in ("/workspace", "/tmp", "/run", "/dev/shm", "/var/tmp", "/home", "/root"):
        for root, dirs, files in os.walk(top, onerror=lambda e: None):
            found += [os.path.join(root, n) for n in files + dirs if "sock" in n]
    with open("/tmp/mark", "w") as out:
        out.write("left by the first program")
    return found
'''
# Its test code (trusted, the task's) patches what the harness's own process holds.
PATCHING_SETUP = "import builtins\nbuiltins.sorted = lambda x: ['forged']\n"
# The program of the second: what the first left, if it sees any.
LOOKING = '''
import os
def f():
    return os.path.exists("/tmp/mark") or len(
        [n for n in os.listdir("/tmp") if n.startswith("candidate-")]) != 1  # its own only
'''


@pytest.fixture
def sandbox_root():
    root = f"/tmp/prs-warm-{os.getpid()}"  # where the sandbox's user can reach it
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def eval_ctx(r, sandbox_root):
    manager = SandboxManager(r, NODE, "bwrap", root=sandbox_root)
    settings = types.SimpleNamespace(warm_graders=True, grader_idle_s=600.0,
                                     memory_scratch_mb=lambda: (64, 64),
                                     sandbox_workspace_mb=1024)

    def make(job: str, tenant: str = "default", instance: dict | None = None) -> JobContext:
        return JobContext(job_id=job, batch_id="b", stage="eval", token="t", node=NODE,
                          instance=instance or {}, sampling={}, tenant=tenant,
                          sandboxes=manager, settings=settings)

    yield make, manager, settings
    warm_graders.close_graders()
    wait_until(lambda: not r.hlen(keys.sandbox_records(NODE)), 30, 0.1, "graders stopped")


def _instance(program_test: str, setup: str = "") -> dict:
    return CodeInstance().load({"statement": "s", "entry_point": "f",
                                "test_list": [program_test], "test_setup": setup})


def _grade(make, job, program, inst, tenant="default"):
    return grade_program(make(job, tenant, inst), program, inst)


def test_a_warm_grader_serves_problem_after_problem_each_in_a_fresh_jail_and_fork(eval_ctx, r):
    make, manager, _ = eval_ctx
    one = "def f():\n    return 1\n"
    # The first grading of this process probes the jail in a fresh sandbox; then warm.
    for job in ("j0", "j1"):
        assert _grade(make, job, one, _instance("assert f() == 1"))["reward"] == 1.0
    graders = warm_graders.graders(600.0)
    assert graders.count() == 1
    started = r.hget(keys.SANDBOXES_STARTED, NODE)
    prying = _grade(make, "j2", PRYING, _instance("assert f() == []", PATCHING_SETUP))
    assert prying["reward"] == 1.0, prying  # nothing with "sock" in its name in sight
    looking = _grade(make, "j3", LOOKING, _instance("assert f() is False"))
    assert looking["reward"] == 1.0, looking  # neither the mark nor the first's directory
    # and the first task's patch of the harness's builtins died with its fork
    assert _grade(make, "j4", "def f():\n    return [2, 1]\n",
                  _instance("assert sorted(f()) == [1, 2]"))["reward"] == 1.0
    assert r.hget(keys.SANDBOXES_STARTED, NODE) == started  # all on the one warm grader
    assert graders.count() == 1
    # another tenant's tasks get a grader of their own (with CPU groups off too: every
    # tenant's cpu_group is "" here)
    assert _grade(make, "j5", one, _instance("assert f() == 1"), tenant="other")["reward"] == 1.0
    assert graders.count() == 2 and int(r.hget(keys.SANDBOXES_STARTED, NODE)) == int(started) + 1


def test_a_cancelled_grading_stops_its_grader_and_an_idle_one_goes(eval_ctx, r):
    make, manager, settings = eval_ctx
    inst = _instance("assert f() == 1")
    _grade(make, "k0", "def f():\n    return 1\n", inst)  # the jail probed: warm from now
    spinning = CodeInstance().load({"statement": "s", "entry_point": "f", "time_limit_s": 60,
                                    "test_list": ["assert f() == 1"]})
    ctx = make("k1", "", spinning)
    caught = []

    def grade():
        try:
            grade_program(ctx, "def f():\n    while True:\n        pass\n", spinning)
        except JobAborted as e:
            caught.append(e)

    before = int(r.hget(keys.SANDBOXES_STARTED, NODE) or 0)
    t = threading.Thread(target=grade)
    t.start()
    # the grading is under way on a grader (one of this node's sandboxes is busy with it)
    wait_until(lambda: warm_graders.graders(600.0)._busy, 30, 0.05, "a busy grader")
    ctx.abort("cancelled")
    t.join(30)
    assert caught and not t.is_alive()
    # the cancelled grading's grader is stopped, not handed on; the idle one stays
    wait_until(lambda: warm_graders.graders(600.0).count() <= 1, 30, 0.1, "grader dropped")
    assert int(r.hget(keys.SANDBOXES_STARTED, NODE) or 0) >= before
    settings.grader_idle_s = 0.5
    assert _grade(make, "k2", "def f():\n    return 1\n", inst)["reward"] == 1.0
    wait_until(lambda: not r.hlen(keys.sandbox_records(NODE)), 30, 0.1, "idle grader stopped")
    assert warm_graders.graders(0.5).count() == 0 and not r.hlen(keys.graders(NODE))


def test_the_janitor_stops_a_grader_whose_pool_stopped_renewing_its_lease(r, sandbox_root):
    manager = SandboxManager(r, NODE, "bwrap", root=sandbox_root)
    grader = warm_graders.Grader(manager, "k", {"code_harness.py": source("code_harness.py")},
                                 GRADER_LIMITS, None)
    try:
        grader.wait_ready()
        assert manager.janitor() == 0  # leased: left alone
        r.hset(keys.graders(NODE), grader.handle, json.dumps({"until": 0, "pid": os.getpid()}))
        assert manager.janitor() == 1
        wait_until(lambda: not grader.alive, 30, 0.05, "the grader's serving ended")
        assert not r.hlen(keys.sandbox_records(NODE)) and not r.hlen(keys.graders(NODE))
    finally:
        grader.stop()
