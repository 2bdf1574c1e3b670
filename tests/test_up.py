"""`prorl-farm up`: the whole farm from one command, over real HTTP; SIGTERM leaves nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests

from prorl_farm.redis_ha import RedisHA
from prorl_farm.trainer import FarmClient, FarmUnauthorized
from tests.farm import ROOT, SANDBOX_DIR, chromium_dom, free_port, sandbox_root, wait_until

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # exited, or a zombie not yet reaped
        return ""


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {_cmd(p)[:100]}")
        except psutil.NoSuchProcess:
            pass
    return out


def _flower_pages_in_chromium(port: int, tmp_path) -> None:
    """What an operator sees in Flower: every pool as a worker, every farm queue on the
    broker page, and the failed jobs' stage tasks as FAILURE with their failure kind."""
    base = f"http://127.0.0.1:{port}"
    workers = chromium_dom(f"{base}/workers", tmp_path / "chromium")
    for pool in ("init-", "run-", "eval-"):
        assert pool in workers, f"{pool} pool missing from Flower's workers page"
    broker = chromium_dom(f"{base}/broker", tmp_path / "chromium")
    for queue in ("init", "run.upnode", "eval.upnode"):
        assert f'<tr id="{queue}">' in broker, f"queue {queue} missing from /broker: {broker}"
    tasks = requests.get(f"{base}/api/tasks", timeout=10).json().values()
    failed = [t for t in tasks if t.get("state") == "FAILURE"]
    assert failed and all("eval_error" in (t.get("exception") or "") for t in failed), failed
    page = chromium_dom(f"{base}/tasks", tmp_path / "chromium")
    assert "FAILURE" in page and "SUCCESS" in page


def test_up_serves_jobs_restarts_pools_and_stops_clean(tmp_path):
    """`up --auth` with PRORL_REDIS_HA=1: a Redis primary, its replica and three sentinels
    under the farm (Flower's broker pages through them too); a pool and the primary killed
    mid-run, each replaced, and everything gone at the stop, the sandbox directory the
    pools made among it."""
    api_port, flower_port = free_port(), free_port()
    sandboxes = Path(sandbox_root(f"{os.getpid()}-up"))
    shutil.rmtree(sandboxes, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    env.update(PRORL_HOME=str(tmp_path / "farm"), PRORL_API_PORT=str(api_port),
               PRORL_FLOWER_PORT=str(flower_port), PRORL_NODE="upnode",
               PRORL_GYM_PORT=str(free_port()),
               PRORL_SANDBOX_DIR=str(sandboxes),
               PRORL_HEARTBEAT_STALE_S="5", PRORL_LOG_LEVEL="WARNING", PRORL_REDIS_HA="1")
    proc = subprocess.Popen([sys.executable, "-m", "prorl_farm.cli", "up", "--auth"], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        anonymous = FarmClient(f"http://127.0.0.1:{api_port}", token="")
        wait_until(anonymous.ready, 60, 0.25, "readyz")  # the probes need no token
        # --auth made up a token: written for the operator (owner-only), and required
        token_file = tmp_path / "farm" / "api-token"
        assert token_file.stat().st_mode & 0o077 == 0
        token = token_file.read_text().strip()
        with pytest.raises(FarmUnauthorized):
            anonymous.submit("synthetic", [{"run_s": 0}])
        with pytest.raises(FarmUnauthorized):
            FarmClient(f"http://127.0.0.1:{api_port}", token=token + "x").submit(
                "synthetic", [{"run_s": 0}])
        with pytest.raises(FarmUnauthorized):  # reads need it too
            anonymous.batches()
        farm = FarmClient(f"http://127.0.0.1:{api_port}", token=token)
        assert farm.batches() == []  # nothing was enqueued

        def flower_up() -> bool:  # Flower starts once the farm is ready
            try:
                return requests.get(f"http://127.0.0.1:{flower_port}/", timeout=10).ok
            except requests.RequestException:  # refused, or slow while it starts
                return False

        wait_until(flower_up, 60, 0.25, "Flower")
        names = " ".join(_cmd(p) for p in _descendants(proc.pid))
        # (redis-server names itself by its address.)
        ha = RedisHA(tmp_path / "farm" / "redis-ha",
                     password=(tmp_path / "farm" / "redis-password").read_text().strip())
        _every_redis_asks_for_the_password(ha)
        _every_redis_is_refused_as_a_backend(ha)
        for part in (*(f"redis-server 127.0.0.1:{port}" for port in ha.ports.values()),
                     "[sentinel]", "gunicorn", "worker init", "worker run", "worker eval",
                     "flower"):
            assert part in names, f"{part} not started: {names}"

        sub = farm.submit("synthetic", [{"run_s": 0.1}, {"fail_stage": "eval"}], n=3)
        results = list(farm.iter_results(sub["batch_id"], timeout_s=60))
        assert sorted(j["id"] for j in results) == sorted(sub["job_ids"])
        assert sorted(j["state"] for j in results) == ["done"] * 3 + ["failed"] * 3

        def flower_saw_stages() -> bool:  # `up` turns task events on for Flower
            tasks = requests.get(f"http://127.0.0.1:{flower_port}/api/tasks", timeout=10)
            return {t.get("name") for t in tasks.json().values()} >= {
                "prorl.init", "prorl.run", "prorl.eval"}

        wait_until(flower_saw_stages, 30, 0.5, "Flower to list the stage tasks")
        _flower_pages_in_chromium(flower_port, tmp_path)

        # A pool that dies is restarted.
        run = next(p for p in _descendants(proc.pid) if "worker run" in _cmd(p))
        os.killpg(run.pid, signal.SIGKILL)
        wait_until(lambda: any("worker run" in _cmd(p) and p.pid != run.pid
                               for p in _descendants(proc.pid)), 30, 0.2, "run pool restart")
        sub = farm.submit("synthetic", [{"run_s": 0.1}])
        assert [j["state"] for j in farm.iter_results(sub["batch_id"], timeout_s=60)] == ["done"]

        # The Redis primary killed: the sentinels promote the replica, the farm follows it,
        # and `up` starts the dead server again (it rejoins as a replica).
        first = ha.primary()
        server = f"redis-server 127.0.0.1:{ha.ports[first]}"
        primary = next(p for p in _descendants(proc.pid) if server in _cmd(p))
        primary.kill()
        sub = farm.submit("synthetic", [{"run_s": 0.1}], n=4)
        assert [j["state"] for j in farm.iter_results(sub["batch_id"], timeout_s=90)] == \
            ["done"] * 4
        assert ha.primary() not in (None, first)
        wait_until(lambda: any(server in _cmd(p) and p.pid != primary.pid
                               for p in _descendants(proc.pid)), 30, 0.2, "the server again")

        everything = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "prorl-farm is up" in out and f"http://127.0.0.1:{api_port}" in out
        assert f"token   {token}" in out
        assert _alive(everything) == []
        assert not sandboxes.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_up_with_a_dev_model_serves_chat_and_100_math_episodes_with_tools(tmp_path, tiny_model):
    """`prorl-farm up --dev-model`: token-exact chat jobs, then the tiny random model runs
    100 `math` episodes with tools through the pools (two RUN processes): every job
    terminal, each end reason recorded, every trajectory prefix-exact (checked turn by turn
    by the farm), no sandbox left; SIGTERM then leaves no process."""
    api_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    env.update(PRORL_HOME=str(tmp_path / "farm"), PRORL_API_PORT=str(api_port),
               PRORL_FLOWER_PORT=str(free_port()), PRORL_LOG_LEVEL="WARNING",
               PRORL_GYM_PORT=str(free_port()),
               PRORL_SANDBOX_DIR=SANDBOX_DIR, PRORL_RUN_PROCESSES="2")
    proc = subprocess.Popen([sys.executable, "-m", "prorl_farm.cli", "up", "--dev-model",
                             str(tiny_model)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        farm = FarmClient(f"http://127.0.0.1:{api_port}")
        wait_until(lambda: farm.ready() and farm.backends(), 90, 0.25, "farm and dev model")
        [backend] = farm.backends()
        assert backend["kind"] == "vllm" and backend["tokenizer"] == str(tiny_model)
        assert backend["healthy"] and backend["in_heap"]
        sub = farm.submit("chat", [{"messages": [{"role": "user", "content": "hello"}]}], n=2,
                          sampling={"max_tokens": 8, "temperature": 1.0,
                                    "ignore_eos": True})  # a random model samples stops too
        jobs = list(farm.iter_results(sub["batch_id"], timeout_s=60))
        assert [j["state"] for j in jobs] == ["done", "done"]
        for j in (farm.job(x["id"]) for x in jobs):
            t = j["result"]
            assert len(t["response_ids"]) == sum(t["response_mask"]) == 8
            assert t["turns"][0]["backend"] == backend["id"]

        instances = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(25)]
        sub = farm.submit("math", instances, n=4, deadline_s=300,
                          sampling={"max_tokens": 12, "temperature": 1.0, "seed": 3,
                                    "max_turns": 3})
        assert len(sub["job_ids"]) == 100
        ended = list(farm.iter_results(sub["batch_id"], timeout_s=300))
        assert len(ended) == 100 and all(j["state"] == "done" for j in ended), \
            [j.get("failure") for j in ended if j["state"] != "done"][:3]
        reasons = set()
        for j in (farm.job(x["id"]) for x in ended):
            t = j["result"]
            reasons.add(t["stats"]["end_reason"])
            assert t["turns"] and all(turn["prefix_checked"] for turn in t["turns"])
            assert sum(t["response_mask"]) == sum(turn["generated"] for turn in t["turns"])
            assert len(t["response_ids"]) == len(t["response_mask"]) \
                == len(t["response_logprobs"])
            assert j["reward"] in (0.0, 1.0)
        assert reasons and reasons <= {"answered", "max_tokens", "max_turns"}, reasons
        wait_until(lambda: not any(s["live"] for s in farm.overview()["sandboxes"]), 20, 0.1,
                   "sandboxes stopped")
        assert farm.backends()[0]["in_flight"] == 0

        # The trainer-loop template as docs/trainers.md runs it (--task letter: even a random
        # model's groups vary), its weight syncs amid carried-over groups: no rollout fails
        # for meeting a drained backend, and the version grows by one per step.
        loop = subprocess.run([sys.executable, "examples/train_loop.py", "--url",
                               f"http://127.0.0.1:{api_port}", "--steps", "3"], env=env,
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert loop.returncode == 0, loop.stderr[-3000:]
        *steps, summary = [json.loads(line) for line in loop.stdout.splitlines()]
        assert [s["policy_version"] for s in steps] == [0, 1, 2]
        assert all(s["groups"] == 4 and s["stats"]["filtered_failed"] == 0 for s in steps), \
            steps
        assert summary == {"steps": 3, "final_version": 3, "groups_staler_than_bound": 0}
        assert farm.backends()[0]["policy_version"] == 3
        wait_until(lambda: farm.backends()[0]["in_flight"] == 0, 30, 0.2, "slots freed")
        everything = _descendants(proc.pid)
        assert any("serve-model" in _cmd(p) for p in everything)
        # Two RUN pool processes (PRORL_RUN_PROCESSES), each with its log.
        assert sum(_cmd(p).endswith("cli worker run") for p in everything) == 2
        assert {"run-0.log", "run-1.log"} <= {f.name for f in (tmp_path / "farm" / "logs")
                                               .iterdir()}
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "model   " in out
        assert _alive(everything) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _up(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "prorl_farm.cli", "up"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _exit_by_itself(proc: subprocess.Popen, timeout_s: float = 60) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"did not exit by itself: {out}") from None
    return out


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def _private_redis_config(up: subprocess.Popen, name: str, home: Path) -> str:
    """A setting of the redis-server that `up` started (found among its children)."""
    import redis

    for child in psutil.Process(up.pid).children(recursive=True):
        if child.name().startswith("redis-server"):
            port = next(c.laddr.port for c in child.net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN)
            password = (home / "redis-password").read_text().strip()
            client = redis.Redis(port=port, password=password, decode_responses=True)
            try:
                return client.config_get(name)[name]
            finally:
                client.close()
    raise AssertionError("no redis-server under `up`")


def _every_redis_asks_for_the_password(ha: RedisHA) -> None:
    """The HA trio: each data server and each sentinel refuses a client without the
    password; their config files are their owner's only."""
    import redis

    for name, port in ha.ports.items():
        stranger = redis.Redis(port=port)
        try:
            with pytest.raises(redis.exceptions.AuthenticationError):
                stranger.ping()
        finally:
            stranger.close()
        assert (ha.data / f"{name}.conf").stat().st_mode & 0o777 == 0o600


def _every_redis_is_refused_as_a_backend(ha: RedisHA) -> None:
    """Both data servers of the HA trio (as the sentinels name them) and its sentinels are
    the farm's own ports: no backend may be registered at any of them."""
    from prorl_farm.access import OWN_PORT, backend_url_refusal, parse_allow_list
    from prorl_farm.config import load_settings

    listeners = load_settings({"PRORL_REDIS_URL": ha.url}).farm_listeners()
    for port in ha.ports.values():
        assert ("127.0.0.1", port) in listeners, (port, listeners)
        assert backend_url_refusal(f"http://localhost:{port}", parse_allow_list(""),
                                   listeners) == OWN_PORT


def _redis_is_the_farms_alone(up: subprocess.Popen, home: Path) -> None:
    """Any other local process: no command line under `up` shows the private Redis's
    password, a client without it is refused, and its files are its owner's only."""
    import redis

    password = (home / "redis-password").read_text().strip()
    assert (home / "redis-password").stat().st_mode & 0o777 == 0o600
    for child in psutil.Process(up.pid).children(recursive=True):
        assert password not in _cmd(child), _cmd(child)
        if child.name().startswith("redis-server"):
            port = next(c.laddr.port for c in child.net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN)
    stranger = redis.Redis(port=port)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            stranger.get("prorl:batches")
    finally:
        stranger.close()
    data = home / "redis"
    assert data.stat().st_mode & 0o777 == 0o700
    files = [p for p in data.rglob("*") if p.is_file()]
    assert files and all(p.stat().st_mode & 0o777 == 0o600 for p in files), \
        [(p.name, oct(p.stat().st_mode)) for p in files]


def test_up_keeps_results_and_queued_jobs_across_a_restart(tmp_path):
    """The private Redis persists (append-only, here with every write synced:
    PRORL_REDIS_APPENDFSYNC=always): after `up` restarts, finished results and the
    dashboard's history are still readable and jobs that were queued run. A second `up`
    beside a running one says why it cannot start instead of looping, and prints no
    banner."""
    api_port, flower_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    env.update(PRORL_HOME=str(tmp_path / "farm"), PRORL_API_PORT=str(api_port),
               PRORL_FLOWER_PORT=str(flower_port), PRORL_NODE="upnode",
               PRORL_GYM_PORT=str(free_port()),
               PRORL_SANDBOX_DIR=SANDBOX_DIR, PRORL_HEARTBEAT_STALE_S="5",
               PRORL_INIT_CONCURRENCY="1", PRORL_LOG_LEVEL="WARNING",
               PRORL_REDIS_APPENDFSYNC="always")
    farm = FarmClient(f"http://127.0.0.1:{api_port}")
    proc = _up(env)
    try:
        wait_until(farm.ready, 60, 0.25, "readyz")
        assert _private_redis_config(proc, "appendfsync", tmp_path / "farm") == "always"
        _redis_is_the_farms_alone(proc, tmp_path / "farm")
        done = farm.submit("synthetic", [{"run_s": 0, "reward": 1.0}], n=3)
        assert len(list(farm.iter_results(done["batch_id"], timeout_s=60))) == 3
        before = farm.history(window_s=3600)
        assert sum(before["ended"]["done"]) == 3 and sum(before["rewards"]) == 3

        second = _up(env)  # same ports, same data directory
        out = _exit_by_itself(second)
        assert second.returncode != 0 and "is up" not in out, out
        assert "another prorl-farm up" in out or "already in use" in out, out
        other_home = dict(env, PRORL_HOME=str(tmp_path / "other"))
        third = _up(other_home)  # only the ports clash
        out = _exit_by_itself(third)
        assert third.returncode != 0 and "already in use" in out and "PRORL_API_PORT" in out

        # Jobs that cannot start before the restart: the INIT stage takes 2 s each, one at
        # a time, so most are still queued when the farm stops.
        waiting = farm.submit("synthetic", [{"init_s": 2.0}], n=6)
        wait_until(lambda: farm.batch(waiting["batch_id"])["counts"]["init"] >= 1, 30)
        time.sleep(1.5)  # past the append-only file's one-second fsync
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out

    proc = _up(env)
    try:
        wait_until(farm.ready, 60, 0.25, "readyz after restart")
        again = farm.batch(done["batch_id"])
        assert again["complete"] and again["counts"]["done"] == 3
        results = list(farm.iter_results(done["batch_id"], timeout_s=10))
        assert sorted(j["id"] for j in results) == sorted(done["job_ids"])
        after = farm.history(window_s=3600)  # the history, through Redis's restart
        assert sum(after["ended"]["done"]) >= 3 and sum(after["passes"]) >= 3, after
        finished = list(farm.iter_results(waiting["batch_id"], timeout_s=120))
        assert len(finished) == 6
        # The jobs cut off mid-stage by the stop are recovered (re-queued) or failed as lost;
        # the ones that were still queued simply run.
        assert sum(j["state"] == "done" for j in finished) >= 4, finished
    finally:
        out = _stop(proc)
    assert proc.returncode == 0, out
