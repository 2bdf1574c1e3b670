"""Sandboxes and the in-sandbox tool server: the same tool suite on every runtime, isolation
under bubblewrap, and nothing left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from prorl_farm.sandbox.abstract import Limits, SandboxError, SandboxSpec, processes_of
from prorl_farm.sandbox.connection import ToolConnection, ToolRejected
from prorl_farm.sandbox.manager import SandboxManager
from tests.farm import ROOT, sandbox_processes, shmem_kb, wait_until

RUNTIMES = ["local", "bwrap"]


def leftovers(manager: SandboxManager, ids) -> dict:
    """Everything a stopped sandbox could leave: processes, files, slots, records, cgroups."""
    cgroups = [p for p in Path("/sys/fs/cgroup/pids").glob("prorl-*")] if Path(
        "/sys/fs/cgroup/pids").exists() else []
    return {
        "processes": {i: processes_of(i) for i in ids if processes_of(i)},
        "dirs": [p.name for p in manager.root.iterdir() if p.name in set(ids)],
        "slots": manager.r.hgetall(manager.slots_key),
        "records": manager.r.hkeys(manager.records_key),
        "cgroups": [c.name for c in cgroups if c.name.removeprefix("prorl-") in set(ids)],
    }


def no_leftovers(manager, ids) -> None:
    assert leftovers(manager, ids) == {"processes": {}, "dirs": [], "slots": {}, "records": [],
                                       "cgroups": []}


@pytest.fixture
def manager_for(r, tmp_path):
    made = []

    def make(runtime: str, **kw) -> SandboxManager:
        if runtime == "bwrap" and not shutil.which("bwrap"):
            pytest.skip("bubblewrap is not installed")
        m = SandboxManager(r, "sbx-node", runtime, root=str(Path("/tmp") / f"prs-{os.getpid()}"),
                           **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        for sandbox in m.records():
            m.stop(sandbox)
        shutil.rmtree(m.root, ignore_errors=True)


@pytest.fixture(params=RUNTIMES)
def sandbox(request, manager_for):
    manager = manager_for(request.param)
    sb = manager.start(SandboxSpec(workspace_files={"src/app.py": "def f():\n    return 1\n"}))
    client = ToolConnection(sb.socket)
    yield sb, client
    client.close()
    manager.stop(sb)
    no_leftovers(manager, [sb.id])


# -- the tool suite, on every runtime -----------------------------------------------------


def test_bash_exit_codes_and_persistence(sandbox):
    sb, c = sandbox
    assert c.bash("true")["exit_code"] == 0
    assert c.bash("exit_code_test() { return 7; }; exit_code_test")["exit_code"] == 7
    assert c.bash("ls /nonexistent")["exit_code"] == 2
    c.bash("cd src && export GREETING=hello && say() { echo \"$GREETING $1\"; }")
    out = c.bash("pwd; say world; echo $PRORL_SANDBOX_IP")
    assert out["output"].split("\n")[:3] == [f"{sb.workdir}/src", "hello world", sb.ip]
    syntax = c.bash("echo 'unclosed")
    assert syntax["exit_code"] == 2 and syntax.get("syntax_error")
    assert c.bash("echo still here")["output"] == "still here\n"


def test_prompts_the_agent_sets_never_reach_the_output(sandbox):
    _, c = sandbox
    c.bash("PS1='>>> '; PS2='... '; PS0='zero '; PROMPT_COMMAND='echo PROMPT'")
    assert c.bash("echo one")["output"] == "one\n"
    assert c.bash("for i in 1 2; do\n  echo $i\ndone")["output"] == "1\n2\n"
    assert c.bash("cat <<'EOF'\na 'b' \\c\nEOF")["output"] == "a 'b' \\c\n"
    assert c.bash("export PS1='$ '; echo two")["output"] == "two\n"


def test_bash_timeout_returns_partial_output_then_the_session_works(sandbox):
    sb, c = sandbox
    c.bash("export KEEP=1")
    t0 = time.monotonic()
    out = c.bash("echo before; sleep 60; echo after", timeout_s=1)
    assert out["timed_out"] and out["output"].startswith("before") and "after" not in out["output"]
    assert time.monotonic() - t0 < 10
    quiet = c.bash("sleep 60", timeout_s=30, no_output_timeout_s=1)
    assert quiet["timed_out"] and quiet["timeout_reason"] == "no output"
    stubborn = c.bash("trap '' INT; sleep 60", timeout_s=1)
    assert stubborn["timed_out"] and stubborn["exit_code"] != 0
    assert c.bash("echo $KEEP")["output"] == "1\n"  # same session, state kept


def test_interactive_commands_do_not_hang(sandbox):
    sb, c = sandbox
    t0 = time.monotonic()
    assert c.bash("read answer; echo got:$answer")["output"] == "got:\n"
    assert c.bash("python3")["exit_code"] == 0  # the REPL reads EOF and exits
    assert c.bash("cat")["exit_code"] == 0
    assert c.bash("git log 2>/dev/null | head -1; true")["exit_code"] == 0
    assert time.monotonic() - t0 < 10


def test_background_processes_and_big_output(sandbox):
    sb, c = sandbox
    assert c.bash("sleep 300 & echo started")["output"] == "started\n"
    out = c.bash("head -c 200000000 /dev/zero | tr '\\0' 'x'; echo; echo done", timeout_s=120)
    assert out["exit_code"] == 0 and out["truncated"]
    assert out["output_bytes"] >= 200_000_000
    assert len(out["output"]) < 100_000 and out["output"].endswith("done\n")
    assert c.call("ping")["pong"]
    assert c.bash("jobs | wc -l")["output"].strip() == "1"  # the background sleep


def test_ipython(sandbox):
    sb, c = sandbox
    assert c.ipython("1 + 1")["results"] == ["2"]
    out = c.ipython("x = 21\nprint('hi')\nx * 2")
    assert out["stdout"] == "hi\n" and out["results"] == ["42"]
    err = c.ipython("1 / 0")["error"]
    assert err["ename"] == "ZeroDivisionError" and "1 / 0" in err["traceback"]
    slow = c.ipython("import time\ntime.sleep(60)", timeout_s=1)
    assert slow["timed_out"] and slow["error"]["ename"] == "KeyboardInterrupt"
    assert c.ipython("x")["results"] == ["21"]  # the kernel kept its state


def test_file_tools(sandbox):
    sb, c = sandbox
    view = c.call("view", path="src/app.py")
    assert view["content"] == "     1\tdef f():\n     2\t    return 1"
    assert c.call("view", path="src/app.py", start_line=2, end_line=2)["content"].strip() == \
        "2\t    return 1"
    assert "src/app.py" in c.call("view", path=".")["entries"]
    c.call("create", path="notes/a.txt", content="x\nx\n")
    with pytest.raises(ToolRejected, match="exists"):
        c.call("create", path="notes/a.txt", content="y")
    with pytest.raises(ToolRejected, match="occurs 2 times"):
        c.call("str_replace", path="notes/a.txt", old_str="x", new_str="y")
    with pytest.raises(ToolRejected, match="not found"):
        c.call("str_replace", path="notes/a.txt", old_str="zzz", new_str="y")
    c.call("str_replace", path="src/app.py", old_str="return 1", new_str="return 2")
    c.call("insert", path="src/app.py", line=0, text="# header")
    assert c.bash("cat src/app.py")["output"] == "# header\ndef f():\n    return 2\n"
    c.call("undo", path="src/app.py")
    c.call("undo", path="src/app.py")
    assert c.bash("cat src/app.py")["output"] == "def f():\n    return 1\n"
    with pytest.raises(ToolRejected, match="no edit"):
        c.call("undo", path="src/app.py")
    for escape in ("../../etc/passwd", "/etc/passwd"):
        with pytest.raises(ToolRejected, match="outside the workspace"):
            c.call("view", path=escape)
    c.bash("ln -s /etc link")
    with pytest.raises(ToolRejected, match="outside the workspace"):
        c.call("create", path="link/evil", content="x")
    with pytest.raises(ToolRejected, match="bad_request"):
        c.call("no_such_tool")


# -- isolation under bubblewrap -----------------------------------------------------------


@pytest.fixture
def bwrap_box(manager_for, redis_server):
    manager = manager_for("bwrap")
    limits = Limits(address_space_bytes=2 * 1024**3, processes=64)
    sb = manager.start(SandboxSpec(limits=limits))
    client = ToolConnection(sb.socket)
    yield manager, sb, client
    client.close()
    manager.stop(sb)
    no_leftovers(manager, [sb.id])


def test_bwrap_network_is_only_its_own_loopback(bwrap_box, redis_server):
    manager, sb, c = bwrap_box
    # The host's Redis is on 127.0.0.1 outside: unreachable from the sandbox.
    host = c.bash(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', "
                  f"{redis_server.port}), 2)\"")
    assert host["exit_code"] != 0 and "refused" in host["output"].lower()
    serve = c.bash("python3 -m http.server 8000 --bind $PRORL_SANDBOX_IP >/dev/null 2>&1 & "
                   "sleep 1; python3 -c \"import urllib.request, os; print(urllib.request."
                   "urlopen(f'http://{os.environ[\\\"PRORL_SANDBOX_IP\\\"]}:8000/').status)\"")
    assert serve["output"].strip().endswith("200"), serve
    outside = subprocess.run([sys.executable, "-c", "import socket; socket.create_connection("
                              f"('{sb.ip}', 8000), 1)"], capture_output=True)
    assert outside.returncode != 0  # and the host cannot reach into the sandbox


def test_bwrap_filesystem_is_read_only_outside_the_workspace(bwrap_box):
    manager, sb, c = bwrap_box
    secret = Path("/root/prorl-test-secret")
    secret.write_text("top secret")
    try:
        for path in ("/usr/evil", "/etc/evil", f"{ROOT}/evil"):
            out = c.bash(f"touch {path}")
            assert out["exit_code"] != 0, out
            assert "Read-only" in out["output"] or "No such file" in out["output"], out
            assert not os.path.exists(path) or path.startswith(("/usr", "/etc"))
        out = c.bash(f"cat {secret}; ls /root")
        assert "top secret" not in out["output"]
        assert c.bash("touch ok && ls")["output"] == "ok\n"
        others = c.bash(f"ls -a {manager.root} 2>/dev/null | wc -l")["output"].strip()
        assert others == "0"  # other sandboxes' files are hidden
    finally:
        secret.unlink()


def test_bwrap_contains_fork_bomb_and_memory_hog(bwrap_box, manager_for):
    manager, sb, c = bwrap_box
    hog = c.bash("python3 -c \"x = bytearray(8 * 1024**3)\"")
    assert hog["exit_code"] != 0 and "MemoryError" in hog["output"]
    bomb = c.bash("bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout_s=20)
    # The cap holds one of three ways: the line runs to its end, the shell's own fork for
    # `sleep` is refused (bash then drops the rest of the line), or the line times out.
    refused = "fork: Resource temporarily unavailable" in bomb["output"]
    assert "survived" in bomb["output"] or refused or bomb["timed_out"], bomb
    assert c.call("ping")["pong"]  # the tool server is fine
    assert "alive" in c.bash("echo alive", timeout_s=20)["output"]  # and so is its shell
    # The host is fine too: another sandbox starts and works.
    other = manager.start(SandboxSpec())
    other_client = ToolConnection(other.socket)
    try:
        assert other_client.bash("echo ok")["output"] == "ok\n"
    finally:
        other_client.close()
        manager.stop(other)


def test_scratch_space_is_bounded_and_a_write_past_it_fails_inside(manager_for):
    """A sandbox's memory-backed directories (/dev/shm, /run) hold at most
    PRORL_SANDBOX_SCRATCH_MB each: a 1 GiB write into each fails inside with ENOSPC. Its
    /tmp and /var/tmp are on the node's disk, beside the workspace and counted in its bound:
    a 1 GiB write into them is stopped at the workspace's limit (``workspace_full``), and
    the node's shared memory grows by no more than the bounds (by 4 GiB without them)."""
    from prorl_farm.toolserver.quota import disk_usage

    manager = manager_for("bwrap", scratch_mb=16, workspace_mb=64)
    sb = manager.start(SandboxSpec(limits=Limits(processes=64)))
    c = ToolConnection(sb.socket)
    try:
        before = shmem_kb()
        for scratch in ("/run", "/dev/shm"):
            out = c.bash(f"df -k --output=size {scratch} | tail -1; dd if=/dev/zero "
                         f"of={scratch}/fill bs=1M count=1024 2>&1 | head -1", timeout_s=120)
            size_kb, message = out["output"].strip().split("\n", 1)
            assert int(size_kb) == 16 * 1024, (scratch, out)
            assert "No space left on device" in message, (scratch, out)
        for scratch in ("/tmp", "/var/tmp"):
            out = c.bash(f"for i in $(seq 128); do head -c 8M /dev/zero > {scratch}/f$i; "
                         f"done; echo wrote-it-all", timeout_s=300)
            assert "wrote-it-all" not in out["output"], (scratch, out)
            assert out["workspace_full"]["limit_mb"] == 64, (scratch, out)
            host = Path(sb.workspace).parent / scratch.strip("/").replace("/", "-")
            assert 64 < disk_usage(str(host)) / 2**20 < 512, scratch  # on the disk, here
            # As for the workspace: the next call still says so (and starts the shell the
            # kill ended again), then the agent removes the files and goes on.
            assert c.bash("echo still")["workspace_full"]["used_mb"] > 64, scratch
            done = c.bash(f"rm -f {scratch}/f*; echo alive")
            assert done["output"] == "alive\n" and "workspace_full" not in done, done
        grew_mb = (shmem_kb() - before) / 1024
        assert grew_mb < 256, grew_mb  # 2 x 16 MiB, and whatever runs beside the test
        assert c.bash("echo alive")["output"] == "alive\n"
    finally:
        c.close()
        manager.stop(sb)


def test_the_workspace_as_a_whole_is_bounded_and_what_writes_past_it_is_stopped(manager_for):
    """The workspace is on the node's disk: the tool server holds it as a whole to
    PRORL_SANDBOX_WORKSPACE_MB. A command that writes 1 GiB in files of 8 MiB (each within
    the file-size limit) into a 64 MiB workspace, in the background and in the foreground,
    is killed well before it is done; the call says ``workspace_full``, and so does every
    call while the workspace stays over; once files are removed, the sandbox goes on."""
    from prorl_farm.toolserver.quota import disk_usage

    manager = manager_for("bwrap", workspace_mb=64)
    sb = manager.start(SandboxSpec(limits=Limits(processes=64)))
    c = ToolConnection(sb.socket)
    try:
        out = c.bash("(for i in $(seq 128); do head -c 8M /dev/zero > bg$i; done; "
                     "echo > bg-done) & for i in $(seq 128); do head -c 8M /dev/zero > f$i; "
                     "done; echo wrote-it-all", timeout_s=300)
        assert "wrote-it-all" not in out["output"], out
        assert out["workspace_full"]["limit_mb"] == 64, out
        used_mb = disk_usage(sb.workspace) / 2**20
        assert 64 < used_mb < 512, used_mb  # 2 GiB without the bound
        assert not (Path(sb.workspace) / "bg-done").exists()  # the background too
        assert c.bash("echo still")["workspace_full"]["used_mb"] > 64
        done = c.bash("rm -f f* bg*; echo alive")
        assert done["output"] == "alive\n" and "workspace_full" not in done, done
    finally:
        c.close()
        manager.stop(sb)


def test_bwrap_as_a_non_root_user(tmp_path, redis_server):
    if not shutil.which("bwrap") or not shutil.which("runuser"):
        pytest.skip("needs bwrap and runuser")
    if os.geteuid() != 0:
        pytest.skip("already not root: the other tests cover it")
    system_python = "/usr/bin/python3"
    if not os.path.exists(system_python) or subprocess.run(
            [system_python, "-c", "import sys; assert sys.version_info[:2] == (3, 11)"]
    ).returncode != 0:
        pytest.skip("needs a system Python 3.11 that user nobody can run")
    from prorl_farm.sandbox.interpreter import usable_by

    if not usable_by(str(ROOT / "prorl_farm"), 65534, 65534):
        pytest.skip("the checkout lies where user nobody cannot read it")
    site = next(p for p in sys.path if p.endswith("site-packages") and ".venv" in p)
    root = Path(tempfile.mkdtemp(prefix="prorl-nobody-", dir="/tmp"))
    os.chmod(root, 0o777)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{site}", "HOME": str(root)}
    try:
        proc = subprocess.run(
            [shutil.which("runuser"), "-u", "nobody", "--", system_python,
             str(ROOT / "tests" / "nonroot_probe.py"), redis_server.url, str(root / "sb")],
            env=env, capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PROBE OK" in proc.stdout, proc.stdout


# -- nothing leaks --------------------------------------------------------------------------


def test_100_sandboxes_leave_nothing_behind(manager_for):
    manager = manager_for("bwrap")
    ids, errors = [], []
    for i in range(100):
        sb = manager.start(SandboxSpec())
        ids.append(sb.id)
        client = ToolConnection(sb.socket)
        if i % 4 == 0:
            # Killed mid-command: the call in flight fails cleanly, the sandbox goes away.
            def call(client=client):
                try:
                    client.bash("sleep 300 & sleep 200", timeout_s=500)
                except SandboxError as e:
                    errors.append(e)

            t = threading.Thread(target=call)
            t.start()
            time.sleep(0.05)
            manager.stop(sb)
            t.join(10)
            assert not t.is_alive()
        else:
            assert client.bash(f"echo {i}")["output"] == f"{i}\n"
            manager.stop(sb)
        client.close()
    assert len(errors) == 25
    no_leftovers(manager, ids)
    assert [p.name for p in manager.root.iterdir()] == [".etc"]  # only the shared identity


def test_a_job_ending_stops_its_sandboxes_only(manager_for, r):
    """stop_for_job finds a job's sandboxes through its index, stops them all, and leaves
    other jobs' running."""
    from prorl_farm import keys

    manager = manager_for("bwrap")
    mine = [manager.start(SandboxSpec(), job_id="job-a") for _ in range(2)]
    other = manager.start(SandboxSpec(), job_id="job-b")
    assert manager.stop_for_job("job-none") == 0
    assert manager.stop_for_job("job-a") == 2
    assert [s.id for s in manager.records()] == [other.id]
    assert not r.exists(keys.job_sandboxes("sbx-node", "job-a"))
    for sb in mine:
        assert not Path(sb.socket).exists()
    client = ToolConnection(other.socket)
    assert client.bash("echo alive")["output"] == "alive\n"
    client.close()
    manager.stop(other)  # a stop by sandbox also leaves no index behind
    assert not r.exists(keys.job_sandboxes("sbx-node", "job-b")) and not manager.records()


def test_a_job_with_a_sandbox_is_marked_for_its_later_stages(manager_for, r):
    """Starting a sandbox for a job marks the job (its claims then say so, and its end looks
    for sandboxes to stop) and tells the starting process once; a job without one is not
    marked, and a job hash that is gone is not made again."""
    from prorl_farm import keys

    manager = manager_for("local")
    r.hset(keys.job("job-m"), "state", "init")
    sb = manager.start(SandboxSpec(), job_id="job-m")
    other = manager.start(SandboxSpec(), job_id="job-gone")
    assert r.hget(keys.job("job-m"), "sandboxes") == "1"
    assert not r.exists(keys.job("job-gone"))
    assert manager.take_started("job-m") and not manager.take_started("job-m")
    assert not manager.take_started("job-none")
    manager.stop(sb)
    manager.stop(other)


def test_node_cap_makes_start_wait_and_janitor_cleans(manager_for, r):
    from prorl_farm.config import load_settings
    from prorl_farm.jobs.store import JobStore
    from prorl_farm.states import JobState
    from tests.farm import farm_env

    manager = manager_for("local", max_sandboxes=2)
    store = JobStore.from_settings(load_settings(farm_env(
        r.connection_pool.connection_kwargs and f"redis://127.0.0.1:"
        f"{r.connection_pool.connection_kwargs['port']}/0")))
    jobs = store.create_jobs("b", "shell", [{}], 3, {}, None)
    a = manager.start(SandboxSpec(), jobs[0].job_id)
    b = manager.start(SandboxSpec(), jobs[1].job_id)
    started = []
    t = threading.Thread(target=lambda: started.append(manager.start(SandboxSpec(),
                                                                     jobs[2].job_id)))
    t.start()
    time.sleep(1.0)
    assert not started  # waiting, not failing, at the cap
    store.finish(jobs[0].job_id, JobState.CANCELLED, "cancelled", "x")
    assert manager.janitor() == 1  # a's job ended: its sandbox goes
    t.join(10)
    assert started and not processes_of(a.id)
    store.r.hset(f"prorl:job:{jobs[1].job_id}", "requeues", 1)  # b's job started over
    assert manager.janitor() == 1 and not processes_of(b.id)
    manager.stop(started[0])
    no_leftovers(manager, [a.id, b.id, started[0].id])


# -- through the farm ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def shell_farm(redis_server, tmp_path_factory):
    from api import create_app
    from prorl_farm.config import load_settings
    from tests.conftest import make_pools
    from tests.farm import farm_env

    overrides = dict(sandbox_dir=f"/tmp/prs-farm-{os.getpid()}", run_concurrency=4)
    pools = make_pools(redis_server, tmp_path_factory.mktemp("shell"), **overrides)
    pools.start()
    client = create_app(load_settings(farm_env(redis_server.url, **overrides))).test_client()
    yield pools, client
    pools.stop()
    shutil.rmtree(overrides["sandbox_dir"], ignore_errors=True)


def _jobs(client, instances):
    from tests.farm import wait_until

    resp = client.post("/v1/jobs", json={"handler": "shell", "instances": instances})
    assert resp.status_code == 202, resp.get_json()
    sub = resp.get_json()
    return sub, lambda: wait_until(
        lambda: client.get(f"/v1/batches/{sub['batch_id']}").get_json()["complete"], 60, 0.1,
        "shell batch")


def test_shell_jobs_run_in_sandboxes_stopped_however_they_end(shell_farm, r):
    from tests.farm import wait_until

    pools, client = shell_farm
    instances = [
        {"files": {"sol.py": "print(6 * 7)\n"}, "setup": ["test -f sol.py"],
         "commands": ["python3 sol.py > out.txt", "echo $PRORL_SANDBOX_IP"],
         "check": "grep -qx 42 out.txt"},
        {"files": {"sol.py": "print(41)\n"}, "commands": ["python3 sol.py > out.txt"],
         "check": "grep -qx 42 out.txt"},
        {"setup": ["exit 3"]},
        {"commands": ["sleep 120"]},
    ]
    sub, finished = _jobs(client, instances)
    slow = sub["job_ids"][3]
    wait_until(lambda: client.get(f"/v1/jobs/{slow}").get_json()["stage"] == "run", 30)
    time.sleep(0.5)
    client.post(f"/v1/jobs/{slow}/cancel")
    finished()
    ok, wrong, broken, cancelled = (client.get(f"/v1/jobs/{i}").get_json() for i in
                                    sub["job_ids"])
    assert ok["state"] == "done" and ok["reward"] == 1.0
    assert ok["result"]["steps"][1]["output"].strip().startswith("127.16.")
    assert wrong["state"] == "done" and wrong["reward"] == 0.0
    assert broken["failure"]["kind"] == "init_error" and "exit 3" in broken["failure"]["message"]
    assert cancelled["state"] == "cancelled"
    # However each ended, its sandbox is gone: no processes, records or slots.
    wait_until(lambda: not r.hlen("prorl:sandboxes:testnode")
               and not r.hlen("prorl:sandbox-slots:testnode"), 10, 0.1, "sandboxes stopped")
    assert sandbox_processes() == []
    root = Path(f"/tmp/prs-farm-{os.getpid()}")
    assert [p.name for p in root.iterdir()] == [".etc"]  # only the shared identity


# -- command lines of the runtimes that cannot run here -------------------------------------


def test_apptainer_command_line(tmp_path):
    from prorl_farm.sandbox.runtimes.apptainer import apptainer_argv

    spec = SandboxSpec(image="/images/task.sif", env={"TASK": "1"})
    argv = apptainer_argv("apptainer", spec, "abc123", tmp_path / "ws", tmp_path / "run",
                          "127.16.0.2", "/usr/bin/python3")
    assert argv[:2] == ["apptainer", "exec"]
    for flag in ("--contain", "--cleanenv", "--no-home", "--writable-tmpfs", "--pid", "--net"):
        assert flag in argv
    assert argv[argv.index("--network") + 1] == "none"
    assert f"{tmp_path / 'ws'}:/workspace" in argv and "--pwd" in argv
    assert "PRORL_SANDBOX_ID=abc123" in argv and "PRORL_SANDBOX_IP=127.16.0.2" in argv
    assert "TASK=1" in argv
    image_at = argv.index("/images/task.sif")
    # The tool server, in isolated mode, its import path as the first argument.
    assert argv[image_at + 1:image_at + 3] == ["/usr/bin/python3", "-I"]
    assert "prorl_farm.toolserver.server" in argv[image_at + 4]
    assert argv[image_at + 5] == "/opt/prorl"
    networked = apptainer_argv("singularity", SandboxSpec(image="/d", network=True), "x",
                               tmp_path, tmp_path, "127.16.0.3", "python3")
    assert "--net" not in networked
    with pytest.raises(SandboxError, match="image"):
        apptainer_argv("apptainer", SandboxSpec(), "x", tmp_path, tmp_path, "ip", "python3")


@pytest.mark.skipif(not (shutil.which("apptainer") or shutil.which("singularity")),
                    reason="apptainer/singularity not on PATH")
def test_apptainer_runtime_for_real(manager_for):  # pragma: no cover - HPC hosts only
    image = os.environ.get("PRORL_TEST_APPTAINER_IMAGE")
    if not image:
        pytest.skip("set PRORL_TEST_APPTAINER_IMAGE to a .sif with python3")
    manager = manager_for("apptainer")
    sb = manager.start(SandboxSpec(image=image))
    client = ToolConnection(sb.socket)
    try:
        assert client.bash("echo hi")["output"] == "hi\n"
    finally:
        client.close()
        manager.stop(sb)
    no_leftovers(manager, [sb.id])


def test_docker_and_bwrap_command_lines(tmp_path):
    from prorl_farm.sandbox.runtimes.bwrap import bwrap_argv
    from prorl_farm.sandbox.runtimes.docker import docker_argv

    spec = SandboxSpec(image="python:3.11")
    argv = docker_argv("docker", spec, "abc", tmp_path / "ws", tmp_path / "run", "127.16.0.2",
                       "/usr/bin/python3")
    assert argv[:3] == ["docker", "run", "--rm"]
    assert argv[argv.index("--network") + 1] == "none"
    assert argv[argv.index("--pids-limit") + 1] == str(spec.limits.processes)
    assert "PRORL_SANDBOX_ID=abc" in argv
    with_lifeline = docker_argv("docker", spec, "abc", tmp_path / "ws", tmp_path / "run",
                                "127.16.0.2", "/usr/bin/python3", lifeline="/run/prorl/l")
    assert with_lifeline[with_lifeline.index("--lifeline") + 1] == "/run/prorl/l"
    from prorl_farm.sandbox.interpreter import sandbox_python

    python = sandbox_python()
    b = bwrap_argv(SandboxSpec(), "abc", tmp_path / "ws", "127.16.0.2", tmp_path, python)
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                 "--unshare-net", "--die-with-parent", "--new-session", "--clearenv",
                 "--as-pid-1"):
        assert flag in b
    assert b[b.index("--uid") + 1] == "1000" and b[b.index("--cap-drop") + 1] == "ALL"
    binds = [b[i + 1:i + 3] for i, flag in enumerate(b) if flag == "--bind"]
    # Writable: the workspace, and /tmp and /var/tmp on disk beside it; nothing else.
    assert binds == [[str(tmp_path / "tmp"), "/tmp"], [str(tmp_path / "var-tmp"), "/var/tmp"],
                     [str(tmp_path / "ws"), "/workspace"]], binds
    tmpfs = [b[i + 1] for i, flag in enumerate(b) if flag == "--tmpfs"]
    assert "/tmp" not in tmpfs and "/dev/shm" in tmpfs and "/run" in tmpfs
    # An allow-list: only these host paths are bound, read-only.
    sources = {b[i + 1] for i, flag in enumerate(b) if flag == "--ro-bind"}
    allowed = ("/usr", "/etc/", str(tmp_path)) + tuple(h for h, _ in python.binds)
    assert all(src.startswith(allowed) for src in sources), sources
    for never in ("/etc/shadow", "/etc/gshadow", "/etc/ssh", "/etc/sudoers", "/root", "/home",
                  "/var", "/srv", "/mnt", str(ROOT)):
        assert never not in sources
    assert "--unshare-net" not in bwrap_argv(SandboxSpec(network=True), "abc", tmp_path,
                                              "ip", tmp_path, python)


def test_a_docker_sandbox_ends_with_the_worker_that_started_it(redis_server, docker_engine,
                                                                 tmp_path):
    """kill -9 of the process that started a docker sandbox (a worker) ends its container
    with no janitor anywhere: the client dies with the worker, and the tool server stops
    at the EOF of the lifeline the client held. The lifeline is gone from the run directory
    once the server holds it: nothing inside can keep it open."""
    from tests.docker_engine import BASE

    root = f"/tmp/prs-lifeline-{os.getpid()}"
    worker = subprocess.Popen(
        [sys.executable, "-c", f"""
import redis, time
from prorl_farm.sandbox.abstract import SandboxSpec
from prorl_farm.sandbox.manager import SandboxManager
manager = SandboxManager(redis.Redis.from_url({redis_server.url!r}), "lifeline-node",
                         "docker", root={root!r}, image={BASE!r})
sandbox = manager.start(SandboxSpec())
print(sandbox.id, sandbox.socket, flush=True)
time.sleep(600)
"""], env={**os.environ, **docker_engine.env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        sandbox_id, socket = worker.stdout.readline().split()
        label = f"label=prorl.sandbox={sandbox_id}"
        assert docker_engine.containers(label)
        run_dir = Path(socket).parent
        assert (run_dir / "tools.sock").exists() and not (run_dir / "lifeline.fifo").exists()
        client = ToolConnection(socket)
        assert client.call("exec", argv=["ls", "/run/prorl"], timeout_s=30)["exit_code"] == 0
        client.close()
    finally:
        os.killpg(worker.pid, 9)
        worker.wait(timeout=30)
        worker.stdout.close()
    try:
        wait_until(lambda: not docker_engine.containers(label), 30, 0.2,
                   "the container ended with its worker")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_pools_threads_track_their_sandboxes_without_racing():
    """Many INIT threads start sandboxes at once: each start also collects the exited ones
    of this process. Two threads collecting the same one raised KeyError (a failed INIT);
    every start must be tracked, every exited process collected once."""
    from prorl_farm.sandbox.runtimes.local import LocalRuntime

    runtime = LocalRuntime()
    exited = [subprocess.Popen(["true"]) for _ in range(300)]
    for p in exited:
        p.wait()
    live = [subprocess.Popen(["sleep", "30"]) for _ in range(16)]
    errors: list[BaseException] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: expose the race
    try:
        for _ in range(20):
            runtime._procs = {f"done-{i}": p for i, p in enumerate(exited)}
            barrier = threading.Barrier(len(live))

            def start(i: int, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                try:
                    runtime._track(f"live-{i}", live[i])
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            threads = [threading.Thread(target=start, args=(i,)) for i in range(len(live))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors[:3]
            assert sorted(runtime._procs) == sorted(f"live-{i}" for i in range(len(live)))
    finally:
        sys.setswitchinterval(switch)
        for p in live:
            p.kill()
            p.wait()
    assert runtime._untrack("live-0") is live[0] and runtime._untrack("live-0") is None


def test_the_process_cap_counts_threads_as_rlimit_nproc_does():
    """Without a pids cgroup a sandbox's cap is RLIMIT_NPROC on top of what its uid runs
    now, and RLIMIT_NPROC counts threads: a farm running as the sandboxes' user has pools of
    many threads, which must be in the count, or the sandbox cannot start its own. As root,
    the threads are a process of a uid nothing else on the machine runs as (the suite's
    other workers run tasks as root and as nobody); else this process's own, beside
    whatever else this user runs."""
    from prorl_farm.sandbox.process import user_task_count

    script = ("import sys, threading; stop = threading.Event(); "
              "[threading.Thread(target=stop.wait, daemon=True).start() for _ in range(40)]; "
              "print('up', flush=True); sys.stdin.read()")
    if os.geteuid() == 0 and shutil.which("setpriv"):
        uid = 40000 + os.getpid() % 20000
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                "/usr/bin/python3", "-c", script]
        expected, before = 41, 0
    else:
        uid = os.getuid()
        argv = [sys.executable, "-c", script]
        expected, before = 40, user_task_count(uid)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        if os.geteuid() == 0:
            assert user_task_count(uid) == expected  # its main thread and the 40
        else:
            assert user_task_count(uid) >= before + expected
    finally:
        proc.communicate("")


def test_without_a_cgroup_each_sandbox_has_its_own_process_cap(manager_for, monkeypatch):
    """Where the farm may not make a pids cgroup, a sandbox's cap is set inside its own user
    namespace, where only its own tasks count: one that forks without end holds its cap and
    no more, and another sandbox of the same host user still forks freely."""
    from prorl_farm.sandbox import cgroups

    monkeypatch.setattr(cgroups, "_ROOT", None)
    manager = manager_for("bwrap")
    if getattr(manager.runtime, "run_as", None) is None and os.geteuid() == 0:
        # Sandboxes as host root (user nobody cannot read this checkout): RLIMIT_NPROC does
        # not bind root, which is why a root farm caps sandboxes with pids cgroups.
        pytest.skip("the sandboxes would run as host root here")
    spec = SandboxSpec(limits=Limits(processes=40))
    a, b = manager.start(spec), manager.start(spec)
    ca, cb = ToolConnection(a.socket), ToolConnection(b.socket)
    bomb = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
            "except OSError:\n    pass\nopen('forked', 'w').write(str(n))\ntime.sleep(60)\n")
    try:
        ca.call("create", path="bomb.py", content=bomb)
        ca.call("bash", command="python3 bomb.py > /dev/null 2>&1 &", timeout_s=10)
        forked = Path(a.workspace) / "forked"  # read from the host: a's shell cannot fork
        for _ in range(200):
            if forked.exists() and forked.read_text().strip():
                break
            time.sleep(0.1)
        assert 10 < int(forked.read_text()) < 40  # it hit its own cap
        free = cb.call("bash", command="for i in $(seq 30); do sleep 2 & done; wait; echo ok",
                       timeout_s=30)
        assert free["output"].strip().endswith("ok") and free["exit_code"] == 0, free
    finally:
        ca.close()
        cb.close()
        manager.stop(a)
        manager.stop(b)
