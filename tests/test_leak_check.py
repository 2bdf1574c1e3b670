"""The suite's leak check (tests/conftest.py: ``no_leaked_processes``) on purpose: a process a
test leaves behind is caught, however it was started (a child, a grandchild, a sandbox's
process, a container's on the suite's Docker engine), while processes
that some other program runs on the same machine (another worker of the suite, a second
checkout's `make check` or `make up`) are never taken for this test's."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from tests.conftest import _leaked
from tests.farm import Pools, own_processes, sandbox_processes, wait_until


def _stop(pid: int) -> None:
    try:
        p = psutil.Process(pid)
        p.kill()
        p.wait(10)
    except psutil.NoSuchProcess:
        pass


def _outsider(env: dict) -> int:
    """A process that is not of this test's tree: started through ``setsid`` by a shell
    that exits at once, so it is reparented to init, as a process of another program on the
    machine is. Returns its pid."""
    out = subprocess.run(["sh", "-c", 'setsid sleep 60 </dev/null >/dev/null 2>&1 & echo $!'],
                         env=env, capture_output=True, text=True, check=True)
    pid = int(out.stdout)
    wait_until(lambda: psutil.Process(pid).ppid() != os.getpid(), 5)
    return pid


def test_a_process_left_behind_is_caught_and_another_programs_is_not():
    before = {p.pid for p in own_processes()}
    pools_before = set(Pools.live)
    # A child, and a grandchild (as a pool's sandbox is): caught.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    sandbox = subprocess.Popen(["sleep", "60"], env={**os.environ, "PRORL_SANDBOX_ID": "leak"})
    outsider = _outsider({**os.environ, "PRORL_SANDBOX_ID": "beside"})
    try:
        wait_until(lambda: len(psutil.Process(parent.pid).children()) == 1, 10)
        leaked = _leaked(before, pools_before)
        assert any(line.startswith(f"{child.pid} ") for line in leaked), leaked
        assert any(line.startswith(f"{sandbox.pid} ") for line in leaked), leaked
        assert len(leaked) == 4, leaked  # the child, the shell and its sleep, the sandbox's
        assert sandbox.pid in sandbox_processes()
        # What runs beside the suite, a sandbox's process included, is not this test's.
        assert not any(line.startswith(f"{outsider} ") for line in leaked)
        assert outsider not in sandbox_processes()
        assert outsider not in {p.pid for p in own_processes()}
    finally:
        for proc in (child, parent, sandbox):
            proc.kill()
            proc.wait()
        for p in own_processes():
            if p.pid not in before:
                _stop(p.pid)
        _stop(outsider)
    assert _leaked(before, pools_before) == []


def test_a_container_left_on_the_suites_engine_is_caught(docker_engine):
    """A container's processes are not the engine's descendants (its shim is reparented to
    init): the check finds them by the engine's exec root, and still not a container of
    another engine (none here: the suite's engine is the only one it looks at)."""
    from tests.docker_engine import BASE

    before = {p.pid for p in own_processes()}
    pools_before = set(Pools.live)
    name = f"prorl-leak-{os.getpid()}"
    docker_engine.run("run", "-d", "--rm", "--name", name, "--network", "none", BASE,
                      "sleep", "120")
    try:
        leaked = wait_until(lambda: [line for line in _leaked(before, pools_before)
                                     if "sleep 120" in line], 30, 0.2, "the container's sleep")
        assert leaked
        shim = [p for p in own_processes() if p.pid not in before
                and "containerd-shim" in " ".join(p.cmdline())]
        assert shim and all(p.ppid() != os.getpid() for p in shim)
    finally:
        docker_engine.run("rm", "-f", name, check=False)
    wait_until(lambda: not _leaked(before, pools_before), 30, 0.2, "the container gone")
