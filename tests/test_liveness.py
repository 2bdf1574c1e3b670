"""Cancellation, stage time limits and dead workers, each with pools of its own."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from api import create_app
from prorl_farm.config import load_settings
from tests.conftest import make_pools
from tests.farm import active_in, farm_env, scrape, wait_until, waiting_on

pytestmark = pytest.mark.slow

TERMINAL = {"done", "failed", "cancelled"}


@pytest.fixture
def farm(redis_server, tmp_path, r):
    """Start pools with per-test settings: ``farm(**overrides) -> (pools, client)``."""
    started, apps = [], []

    def start(**overrides):
        pools = make_pools(redis_server, tmp_path, **overrides)
        pools.start()
        started.append(pools)
        app = create_app(load_settings(farm_env(redis_server.url, **overrides)))
        apps.append(app)
        return pools, app.test_client()

    yield start
    for app in apps:  # its Redis and broker connections, closed here rather than by the GC
        app.extensions["prorl"].close()
    for pools in started:
        pools.stop()


def submit(client, instances, n=1, **kw):
    resp = client.post("/v1/jobs", json={"handler": "synthetic", "instances": instances, "n": n,
                                         **kw})
    assert resp.status_code == 202, resp.get_json()
    return resp.get_json()


def job(client, job_id):
    return client.get(f"/v1/jobs/{job_id}").get_json()


def wait_batch(client, batch_id, timeout_s=60):
    def stuck() -> str:
        summary = client.get(f"/v1/batches/{batch_id}").get_json()
        ids = client.application.extensions["prorl"].store.batch_job_ids(batch_id)
        raws = client.application.extensions["prorl"].store.get_many_raw(ids)
        left = [{k: v for k, v in raw.items() if k not in ("instance", "sampling")}
                for raw in raws if raw["state"] not in TERMINAL]
        return f"batch {summary}; unfinished: {left[:3]}"

    return wait_until(
        lambda: (s := client.get(f"/v1/batches/{batch_id}").get_json())["complete"] and s,
        timeout_s, 0.1, stuck)


def test_cancel_queued_job_never_starts(farm, r):
    pools, client = farm(init_concurrency=1)
    blocker = submit(client, [{"init_s": 3}])["job_ids"][0]
    wait_until(lambda: job(client, blocker)["phase"] == "active", 20, what="blocker in init")
    target = submit(client, [{"init_s": 0}])["job_ids"][0]
    resp = client.post(f"/v1/jobs/{target}/cancel").get_json()
    assert resp["cancelled"] == 1 and resp["job"]["state"] == "cancelled"
    assert resp["job"]["failure"]["kind"] == "cancelled" and resp["job"]["reward"] is None
    # Cancelling again is harmless and changes nothing.
    assert client.post(f"/v1/jobs/{target}/cancel").get_json()["cancelled"] == 0
    wait_until(lambda: job(client, blocker)["state"] == "done", 30, what="blocker done")
    time.sleep(0.5)
    raw = r.hgetall(f"prorl:job:{target}")
    assert "t_init_start" not in raw and raw["state"] == "cancelled"


def test_cancel_running_job_stops_its_stage(farm):
    # One RUN slot: if the cancelled stage kept running, the next job could not start.
    pools, client = farm(run_concurrency=1)
    for mode in ("sleep", "compute"):
        running = submit(client, [{"run_s": 60, "mode": mode}])["job_ids"][0]
        wait_until(lambda r=running: (j := job(client, r))["stage"] == "run"
                   and j["phase"] == "active", 20, what="job running")
        assert client.post(f"/v1/jobs/{running}/cancel").get_json()["cancelled"] == 1
        after = submit(client, [{"run_s": 0.01}])["job_ids"][0]
        wait_until(lambda a=after: job(client, a)["state"] == "done", 15,
                   what="next job through the single RUN slot")
        j = job(client, running)
        assert j["state"] == "cancelled" and j["timings"]["run"]["active_s"] < 5


def test_cancel_batch(farm):
    pools, client = farm(run_concurrency=4)
    sub = submit(client, [{"run_s": 60}], n=12)
    wait_until(lambda: client.get(f"/v1/batches/{sub['batch_id']}").get_json()
               ["counts"]["run"] == 12, 20, what="all jobs in run")
    resp = client.post(f"/v1/batches/{sub['batch_id']}/cancel").get_json()
    assert resp["cancelled"] == 12
    summary = wait_batch(client, sub["batch_id"], 5)
    assert summary["counts"]["cancelled"] == 12


def test_stage_time_limit_fails_with_timeout(farm):
    pools, client = farm(run_timeout_s=1)
    sub = submit(client, [{"run_s": 20}, {"run_s": 5, "mode": "compute"}])
    wait_batch(client, sub["batch_id"], timeout_s=30)
    for job_id in sub["job_ids"]:
        j = job(client, job_id)
        assert j["failure"]["kind"] == "timeout", j
        assert "run stage passed its deadline" in j["failure"]["message"]


def test_sigkill_of_run_pool_mid_batch_leaves_no_job_stuck(farm, r):
    pools, client = farm(run_concurrency=8, max_requeues=1)
    sub = submit(client, [{"init_s": 0.05, "run_s": 2.0, "eval_s": 0.05}], n=40)
    wait_until(lambda: len(active_in(r, sub["job_ids"], "run")) >= 4, 60, what="jobs running")
    run_pid = pools.procs["run"].pid
    pools.pause("run")  # what it holds, read exactly
    held = active_in(r, sub["job_ids"], "run")
    pools.kill("run", signal.SIGKILL)
    assert not psutil.pid_exists(run_pid) or psutil.Process(run_pid).status() == "zombie"
    assert held
    time.sleep(1.0)
    restarted_at = time.time()
    pools.start("run", wait=False)
    pools.wait_ready("run", after=restarted_at)
    summary = wait_batch(client, sub["batch_id"], timeout_s=120)
    assert summary["counts"]["done"] + summary["counts"]["failed"] == 40
    jobs = [job(client, i) for i in sub["job_ids"]]
    assert {j["state"] for j in jobs} <= {"done", "failed"}
    failed = [j for j in jobs if j["state"] == "failed"]
    assert all(j["failure"]["kind"] == "worker_lost" for j in failed), failed
    # The jobs the dead pool ran were recovered by starting again at INIT, once each, with
    # a line of history; no other job was touched.
    requeued = {j["id"] for j in jobs if j["requeues"]}
    assert held <= requeued and all(j["requeues"] <= 1 for j in jobs)
    assert all(j["attempts"][0]["stage"] == "run" for j in jobs if j["requeues"])
    assert all(j["reward"] == 1.0 for j in jobs if j["state"] == "done")
    assert r.zcard("prorl:active") == 0
    # The operator sees what the reaper did, and nothing is left in a non-terminal state.
    m = scrape(client)
    reaped = sum(v for (name, labels), v in m.items()
                 if name == "prorl_reaper_actions_total" and ("outcome", "requeue") in labels)
    assert reaped == len(requeued)
    assert all(m[("prorl_jobs", (("state", s),))] == 0 for s in ("queued", "init", "run",
                                                                  "eval"))


@pytest.mark.parametrize("presence", [True, False], ids=["presence", "heartbeat-age-only"])
def test_worker_lost_after_requeues_run_out(farm, presence):
    # With presence, the heartbeat stale time is set far beyond the test's waits: only the
    # pool's vanished Redis connection can tell that it died. Without, heartbeat age does.
    pools, client = farm(max_requeues=0, presence=int(presence),
                         heartbeat_stale_s=600 if presence else 3)
    sub = submit(client, [{"run_s": 30}], n=3)
    wait_until(lambda: client.get(f"/v1/batches/{sub['batch_id']}").get_json()
               ["counts"]["run"] == 3, 20, what="jobs in run")
    wait_until(lambda: all(job(client, i)["phase"] == "active" for i in sub["job_ids"]), 20,
               what="jobs active")
    pools.kill("run", signal.SIGKILL)
    summary = wait_batch(client, sub["batch_id"], timeout_s=30)
    assert summary["counts"]["failed"] == 3
    for job_id in sub["job_ids"]:
        j = job(client, job_id)
        assert j["failure"]["kind"] == "worker_lost" and j["reward"] is None
        assert ("process is gone" if presence else "heartbeat") in j["failure"]["message"]


def test_jobs_waiting_on_a_dead_nodes_queue_are_reaped(farm, r):
    # One RUN slot and no restart: the jobs queued behind it wait on run.testnode, whose
    # pool went silent, so the reaper must end them (re-queue once, then worker_lost).
    pools, client = farm(run_concurrency=1, max_requeues=1)
    sub = submit(client, [{"run_s": 30}], n=6)
    wait_until(lambda: waiting_on(r, "run.testnode") >= 5, 20, what="jobs queued on run")
    pools.kill("run", signal.SIGKILL)
    summary = wait_batch(client, sub["batch_id"], timeout_s=60)
    assert summary["counts"]["failed"] == 6
    jobs = [job(client, i) for i in sub["job_ids"]]
    assert {j["failure"]["kind"] for j in jobs} == {"worker_lost"}
    assert any("no live run pool on node testnode" in j["failure"]["message"] for j in jobs)
    assert all(j["requeues"] == 1 for j in jobs)
    assert waiting_on(r, "run.testnode") == 0 and r.zcard("prorl:active") == 0


def test_a_node_stopped_with_requeue_on_stop_hands_its_jobs_to_another(redis_server, r,
                                                                        tmp_path):
    """SIGTERM to a node's pools (scancel of a worker node): what it held and what waited on
    its queues starts again at INIT on another node at once, failing nothing and without
    spending a re-queue; nothing waits for the heartbeat stale time (set long here)."""
    settings = dict(requeue_on_stop=1, heartbeat_stale_s=120, run_concurrency=2,
                    max_requeues=0)
    leaving = make_pools(redis_server, tmp_path / "a", node="leaving", **settings)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    leaving.start()
    staying = None
    try:
        app = create_app(load_settings(farm_env(redis_server.url, **settings)))
        client = app.test_client()
        sub = submit(client, [{"run_s": 3.0}], n=6)
        # Two run, four wait on run.leaving behind them.
        wait_until(lambda: waiting_on(r, "run.leaving") == 4, 30, what="queued")
        t0 = time.monotonic()
        leaving.stop()
        staying = make_pools(redis_server, tmp_path / "b", node="staying", **settings)
        staying.start()
        summary = wait_batch(client, sub["batch_id"], timeout_s=60)
        jobs = [job(client, i) for i in sub["job_ids"]]
        assert summary["counts"]["done"] == 6, [(j["failure"], j["attempts"]) for j in jobs]
        assert time.monotonic() - t0 < 40  # not the 120 s stale time
        assert {j["node"] for j in jobs} == {"staying"}
        assert all(j["requeues"] == 0 for j in jobs)  # max_requeues=0, yet none failed
        assert all("node leaving left" in j["attempts"][-1]["reason"] for j in jobs)
        # Each job at least once (one delivered to the leaving INIT pool meanwhile is handed
        # back again).
        m = scrape(client)
        assert m[("prorl_reaper_actions_total", (("mode", "leave"),
                                                 ("outcome", "requeue")))] >= 6
    finally:
        leaving.stop()
        if staying is not None:
            staying.stop()
