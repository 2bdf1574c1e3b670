"""`prorl-farm up`: the whole farm from one command, over real HTTP; SIGTERM leaves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
import requests

from prorl_farm.client import FarmClient
from tests.farm import ROOT, SANDBOX_DIR, free_port, wait_until

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


def test_up_serves_jobs_restarts_pools_and_stops_clean(tmp_path):
    api_port, flower_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    env.update(PRORL_HOME=str(tmp_path / "farm"), PRORL_API_PORT=str(api_port),
               PRORL_FLOWER_PORT=str(flower_port), PRORL_NODE="upnode",
               PRORL_SANDBOX_DIR=SANDBOX_DIR,
               PRORL_HEARTBEAT_STALE_S="5", PRORL_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "prorl_farm.cli", "up"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        farm = FarmClient(f"http://127.0.0.1:{api_port}")
        wait_until(farm.ready, 60, 0.25, "readyz")
        names = " ".join(_cmd(p) for p in _descendants(proc.pid))
        for part in ("redis-server", "gunicorn", "worker init", "worker run", "worker eval",
                     "flower"):
            assert part in names, f"{part} not started: {names}"

        sub = farm.submit("synthetic", [{"run_s": 0.1}, {"fail_stage": "eval"}], n=3)
        results = list(farm.iter_results(sub["batch_id"], timeout_s=60))
        assert sorted(j["id"] for j in results) == sorted(sub["job_ids"])
        assert sorted(j["state"] for j in results) == ["done"] * 3 + ["failed"] * 3
        assert requests.get(f"http://127.0.0.1:{flower_port}/", timeout=10).status_code == 200

        def flower_saw_stages() -> bool:  # `up` turns task events on for Flower
            tasks = requests.get(f"http://127.0.0.1:{flower_port}/api/tasks", timeout=10)
            return {t.get("name") for t in tasks.json().values()} >= {
                "prorl.init", "prorl.run", "prorl.eval"}

        wait_until(flower_saw_stages, 30, 0.5, "Flower to list the stage tasks")

        # A pool that dies is restarted.
        run = next(p for p in _descendants(proc.pid) if "worker run" in _cmd(p))
        os.killpg(run.pid, signal.SIGKILL)
        wait_until(lambda: any("worker run" in _cmd(p) and p.pid != run.pid
                               for p in _descendants(proc.pid)), 30, 0.2, "run pool restart")
        sub = farm.submit("synthetic", [{"run_s": 0.1}])
        assert [j["state"] for j in farm.iter_results(sub["batch_id"], timeout_s=60)] == ["done"]

        everything = _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "prorl-farm is up" in out and f"http://127.0.0.1:{api_port}" in out
        assert _alive(everything) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_up_with_a_dev_model_serves_token_exact_chat_jobs(tmp_path, tiny_model):
    api_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    env.update(PRORL_HOME=str(tmp_path / "farm"), PRORL_API_PORT=str(api_port),
               PRORL_FLOWER_PORT=str(free_port()), PRORL_LOG_LEVEL="WARNING",
               PRORL_SANDBOX_DIR=SANDBOX_DIR)
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
                          sampling={"max_tokens": 8, "temperature": 1.0})
        jobs = list(farm.iter_results(sub["batch_id"], timeout_s=60))
        assert [j["state"] for j in jobs] == ["done", "done"]
        for j in (farm.job(x["id"]) for x in jobs):
            t = j["result"]
            assert len(t["response_ids"]) == sum(t["response_mask"]) == 8
            assert t["turns"][0]["backend"] == backend["id"]
        everything = _descendants(proc.pid)
        assert any("serve-model" in _cmd(p) for p in everything)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "model   " in out
        assert _alive(everything) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
