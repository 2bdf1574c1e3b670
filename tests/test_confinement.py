"""Escape and reward-hacking attempts, driven through the real pipeline (API, pools, bwrap
sandboxes) by a scripted policy: the ``shell`` handler's commands are the adversary.

Every attempt must fail or earn reward 0, and an honest episode beside them must still earn
1. The suite runs three times: with the pools as root (the usual case in containers and CI),
as an unprivileged user, and with the ``docker`` runtime (where an engine can run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.farm import (
    ROOT,
    Pools,
    docker_settings,
    farm_env,
    part_param,
    pool_user,
    run_batch,
    sandbox_processes,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not shutil.which("bwrap"),
                                                   reason="needs bubblewrap")]

SECRET = f"SECRET-{uuid.uuid4().hex}"


@pytest.fixture(scope="module", params=["root", "nobody", part_param("docker")])
def farm(request, redis_server, tmp_path_factory):
    """Pools (as root, or as user nobody, or as root with docker sandboxes on a private
    engine, in an image built here), an API client, and secrets planted on the host where an
    agent would look: the Redis data directory, the pools' log directory, a reference file
    outside any sandbox."""
    from api import create_app
    from prorl_farm.config import load_settings

    docker = docker_settings(request)
    user = pool_user("root" if docker else request.param)
    logs = tmp_path_factory.mktemp(f"confinement-{request.param}")
    sandbox_dir = f"/tmp/prs-conf-{os.getpid()}-{request.param}"
    os.makedirs(sandbox_dir, exist_ok=True)
    if user is not None:
        os.chown(sandbox_dir, 65534, 65534)
        os.chmod(logs, 0o777)
    planted = {
        "redis": redis_server.tmp / "planted-reference.txt",
        "logs": logs / "planted-reference.txt",
        "host": Path("/srv") / f"prorl-reference-{os.getpid()}.txt",
    }
    for path in planted.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(SECRET + "\n")
        os.chmod(path, 0o644)  # world-readable: only confinement keeps it from an agent
    env = farm_env(redis_server.url, sandbox_dir=sandbox_dir, run_concurrency=8, **docker)
    pools = Pools(env, logs, user=user)
    try:
        pools.start()
        yield create_app(load_settings(env)).test_client(), planted, sandbox_dir, pools
    finally:
        pools.stop()
        if docker:  # no container of a sandbox outlives its job
            engine = request.getfixturevalue("docker_engine")
            wait_until(lambda: not engine.containers("label=prorl.sandbox"), 30, 0.5,
                       "the sandboxes' containers gone")
        for path in planted.values():
            path.unlink(missing_ok=True)
        shutil.rmtree(sandbox_dir, ignore_errors=True)


def _run(client, instances: list[dict], timeout_s: float = 120) -> list[dict]:
    return run_batch(client, {"handler": "shell", "instances": instances,
                              "deadline_s": timeout_s}, timeout_s)


HONEST = {"files": {"sol.py": "print(6 * 7)\n"}, "commands": ["python3 sol.py > out.txt"],
          "check": "grep -qx 42 out.txt"}


def _loot(paths: list[str]) -> dict:
    """An episode that copies whatever it can read of ``paths`` into its workspace; the
    check rewards it if the secret (or a shadow entry) made it out."""
    reads = "; ".join(f"cat {p} >> loot.txt 2>&1" for p in paths)
    return {"commands": [reads, "cat loot.txt"],
            "check": f"grep -q -e {SECRET} -e '^root:' loot.txt"}


def test_reading_what_is_outside_the_task_earns_nothing(farm):
    client, planted, sandbox_dir, _ = farm
    targets = [
        ["/etc/shadow", "/etc/gshadow", "/etc/sudoers"],
        [str(planted["redis"]), str(planted["redis"].parent) + "/*"],
        [str(planted["logs"]), str(planted["logs"].parent) + "/*.log"],
        [str(planted["host"]), "/srv/*"],
        [f"{ROOT}/README.md", f"{ROOT}/tests/test_confinement.py", f"{ROOT}/.git/config"],
        [f"{sandbox_dir}/*/workspace/*", "/proc/1/environ", "/proc/1/cmdline"],
    ]
    jobs = _run(client, [HONEST] + [_loot(t) for t in targets])
    honest, *attacks = jobs
    assert honest["state"] == "done" and honest["reward"] == 1.0, honest
    for job, paths in zip(attacks, targets):
        assert job["state"] == "done" and job["reward"] == 0.0, (paths, job)
        text = json.dumps(job["result"])
        assert SECRET not in text and "root:$" not in text and "root:*" not in text, paths
    # The project checkout is not there at all; the farm's own package is, read-only.
    readme = attacks[4]["result"]["steps"][1]["output"]
    assert "No such file" in readme and "prorl-farm" not in readme


def test_another_jobs_sandbox_is_out_of_reach(farm):
    client, _, sandbox_dir, _ = farm
    victim_secret = f"VICTIM-{uuid.uuid4().hex}"
    victim = client.post("/v1/jobs", json={"handler": "shell", "instances": [{
        "files": {"answer.txt": victim_secret}, "commands": ["sleep 30"]}]}).get_json()
    victim_id = victim["job_ids"][0]
    wait_until(lambda: client.get(f"/v1/jobs/{victim_id}").get_json()["stage"] == "run", 60,
               0.2, "victim running")
    paths = [f"{sandbox_dir}/*/workspace/answer.txt", "/workspace/../*/workspace/answer.txt",
             "/proc/*/root/workspace/answer.txt", "/proc/*/cwd/answer.txt"]
    [thief] = _run(client, [{"commands": ["; ".join(f"cat {p} >> loot.txt 2>&1"
                                                    for p in paths)],
                             "check": f"grep -q {victim_secret} loot.txt"}])
    assert thief["reward"] == 0.0 and victim_secret not in json.dumps(thief["result"])
    client.post(f"/v1/jobs/{victim_id}/cancel")
    wait_until(lambda: not sandbox_processes(), 30, 0.2, "the victim's sandbox stopped")


def test_a_killed_run_pool_leaves_no_sandbox_behind(farm):
    """kill -9 of the RUN pool (its whole process group) while its episodes run: their
    sandboxes outlive it (INIT started them: bwrap's die with that pool, not with RUN; with
    docker, the engine runs the containers). The jobs are re-queued and done again in new
    sandboxes; the orphans are stopped by the node's janitor, whichever pool holds it, and
    nothing of them is left."""
    import signal

    client, _, _, pools = farm
    resp = client.post("/v1/jobs", json={"handler": "shell", "n": 3, "instances": [{
        "commands": ["sleep 8", "echo ok > out.txt"], "check": "grep -qx ok out.txt"}]})
    sub = resp.get_json()
    wait_until(lambda: all(client.get(f"/v1/jobs/{i}").get_json()["stage"] == "run"
                           for i in sub["job_ids"]), 60, 0.2, "the episodes running")
    time.sleep(1.0)  # into their first command
    orphans = set(sandbox_processes())
    assert orphans
    pools.kill("run", signal.SIGKILL)
    assert set(sandbox_processes()) & orphans, "the sandboxes outlive their pool"
    pools.start("run")
    wait_until(lambda: client.get(f"/v1/batches/{sub['batch_id']}").get_json()["complete"],
               120, 0.5, "the batch")
    for job_id in sub["job_ids"]:
        job = client.get(f"/v1/jobs/{job_id}").get_json()
        assert job["state"] == "done" and job["reward"] == 1.0, job
        assert job["requeues"] == 1 and job["attempts"][0]["stage"] == "run", job
    wait_until(lambda: not set(sandbox_processes()) & orphans, 60, 0.5,
               "the orphaned sandboxes stopped")
    wait_until(lambda: not sandbox_processes(), 60, 0.5, "every sandbox stopped")


def test_the_tool_server_survives_whatever_the_agent_kills(farm):
    client, _, _, _ = farm
    [job] = _run(client, [{
        "files": {"sol.py": "print(6 * 7)\n"},
        "commands": ["kill -9 -1; kill -KILL 1; kill -TERM 1; kill -INT 1; kill -HUP 1; "
                     "pkill -9 -f toolserver.server; pkill -9 -f prorl_farm; echo killed",
                     "python3 -c 'import os, signal; os.kill(1, signal.SIGKILL)'; echo again",
                     "kill -9 $$",
                     "echo still-here; python3 sol.py > out.txt"],
        "check": "grep -qx 42 out.txt"}])
    assert job["state"] == "done", job
    steps = job["result"]["steps"]
    # Nothing the agent may signal but its own shell: the tool server, pid 1, is not its.
    assert steps[0]["output"].rstrip().endswith("killed") and "again" in steps[1]["output"]
    # The one process it can kill, its shell: the tool server reports it and restarts it.
    assert steps[2].get("session_restarted") and steps[2]["exit_code"] == -1, steps[2]
    assert steps[3]["output"].startswith("still-here"), steps
    assert job["reward"] == 1.0  # the episode went on after every attempt


def test_writes_outside_the_workspace_fail(farm):
    client, _, _, _ = farm
    targets = ["/usr/local/bin/evil", "/etc/evil", "/opt/prorl/prorl_farm/evil.py", "/evil",
               f"{ROOT}/evil", "/srv/evil"]
    [job] = _run(client, [{"commands": ["; ".join(f"echo x > {t} 2>&1 && echo WROTE {t}"
                                                  for t in targets) + "; true"],
                           "check": "true"}])
    assert "WROTE" not in job["result"]["steps"][0]["output"], job["result"]
    for target in targets:
        assert not os.path.exists(target), target


def test_tricks_on_the_check_earn_nothing(farm):
    """The check (hidden from RUN) runs in a fresh sandbox on a copy of the workspace, in a
    clean environment: shell functions, aliases, PATH, rc files, Python user sites, links to
    files elsewhere: nothing of it applies."""
    client, _, _, _ = farm
    wrong = "echo 41 > out.txt"
    fake_grep = "mkdir -p bin && printf '#!/bin/sh\\nexit 0\\n' > bin/grep && chmod +x bin/grep"
    user_site = ".local/lib/python3.11/site-packages"
    tricks = [
        [wrong, "grep() { return 0; }; export -f grep; alias grep=true"],
        [wrong, fake_grep, "export PATH=$PWD/bin:$PATH; hash -r"],
        [wrong, "echo 'grep() { return 0; }' > .bashrc; cp .bashrc .bash_profile"],
        [wrong, f"mkdir -p {user_site} && echo 'import os; os._exit(0)' > "
                f"{user_site}/usercustomize.py",
         "echo 'import os; os._exit(0)' > sitecustomize.py"],
        ["ln -s /etc/hostname out.txt; ln -s /workspace/../../etc/passwd passwd"],
        ["echo 42 > /tmp/out.txt; ln -s /tmp/out.txt out.txt"],
    ]
    checks = ["grep -qx 42 out.txt"] * 3 + [
        "python3 -c \"import sys; sys.exit(0 if open('out.txt').read().strip() == '42' "
        "else 1)\"", "grep -qx 42 out.txt", "grep -qx 42 out.txt"]
    instances = [HONEST] + [{"commands": t, "check": c} for t, c in zip(tricks, checks)]
    honest, *attacks = _run(client, instances)
    assert honest["reward"] == 1.0, honest
    for job, trick in zip(attacks, tricks):
        assert job["state"] == "done" and job["reward"] == 0.0, (job["failure"], trick)


def test_run_never_sees_the_check(farm):
    client, _, _, _ = farm
    [job] = _run(client, [{"commands": ["env | grep -i check; ls -a /workspace"],
                           "check": f"test {SECRET} = {SECRET}"}])
    assert SECRET not in json.dumps(job["result"])  # RUN's view has no check to leak


def test_extra_read_only_paths_are_bound_only_under_the_operators_roots(tmp_path):
    from prorl_farm.errors import SandboxError
    from prorl_farm.sandbox.manager import check_ro_paths

    data = tmp_path / "datasets" / "envs"
    data.mkdir(parents=True)
    ok = check_ro_paths({"/mnt/envs": str(data)}, [str(tmp_path / "datasets")])
    assert ok == {"/mnt/envs": str(data)}
    for inside, host in (("/mnt/x", "/etc"), ("/mnt/x", str(data / ".." / ".." )),
                         ("/etc/x", str(data)), ("/workspace", str(data)), ("rel", str(data))):
        with pytest.raises(SandboxError):
            check_ro_paths({inside: host}, [str(tmp_path / "datasets")])
    assert subprocess.run(["true"]).returncode == 0
