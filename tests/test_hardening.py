"""Recovery the way production hits it: parallel submitters with deep queues and no fault
(no job may be taken for lost), a really lost message (recovered), a Redis restart under
running pools, and a plain `celery worker` (refused unless it consumes one farm queue)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import redis

from prorl_farm.trainer import FarmClient
from tests.conftest import make_pools
from tests.farm import (
    ROOT,
    RedisServer,
    farm_env,
    gunicorn_api,
    open_slots,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.slow


def test_parallel_submitters_with_deep_queues_lose_no_healthy_job(redis_server, r, tmp_path):
    """4 submitters x 10 requests x 125 jobs (5,000 jobs) against real pools, with the
    reaper's timings lowered so that queues stay deep far longer than the stale time: every
    job ends done, none re-queued, none failed."""
    from tests.farm import free_port

    pools = make_pools(redis_server, tmp_path, heartbeat_stale_s=2, reap_interval_s=0.2,
                       run_concurrency=64)
    port = free_port()
    api = gunicorn_api(pools.env, port, tmp_path / "api.log")
    try:
        pools.start()
        farm = FarmClient(f"http://127.0.0.1:{port}")
        wait_until(farm.ready, 30, 0.2, "api ready")
        batches: list[str] = []
        errors: list[BaseException] = []

        def submitter(k: int) -> None:
            try:
                for _ in range(10):
                    sub = farm.submit("synthetic", [{"run_s": 0.1}] * 25, n=5,
                                      batch_id=f"sub{k}")
                    assert len(sub["job_ids"]) == 125
                batches.append(f"sub{k}")
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        states: Counter = Counter()
        for batch in batches:
            jobs = list(farm.iter_results(batch, expected=1250, wait_s=20, timeout_s=600))
            states.update(j["state"] for j in jobs)
            requeued = [j for j in jobs if j["requeues"]]
            assert not requeued, [a["reason"] for j in requeued[:3] for a in j["attempts"]]
        assert states == {"done": 5_000}, states
        assert r.zcard("prorl:active") == 0
    finally:
        stop_process(api)
        pools.stop()


def test_a_message_lost_in_transit_is_recovered(redis_server, r, tmp_path, client):
    """A worker that pops a message and dies before kombu records it as unacked loses it:
    simulated by popping a queued job's message straight off the broker list. Once a job
    pushed after it has been claimed, the reaper re-queues the lost one, which then runs."""
    pools = make_pools(redis_server, tmp_path)
    body = {"handler": "synthetic", "instances": [{"run_s": 0}], "n": 2}
    open_slots(r)  # as a pool would: the messages go onto the queue, nobody consuming yet
    try:
        first = client.post("/v1/jobs", json=body).get_json()
        stolen = r.rpop("init")  # the oldest message: the first job's
        assert stolen is not None and first["job_ids"][0] in stolen
        time.sleep(0.05)
        later = client.post("/v1/jobs", json=body).get_json()
        pools.start()
        ids = first["job_ids"] + later["job_ids"]
        wait_until(lambda: all(client.get(f"/v1/jobs/{j}").get_json()["state"] == "done"
                               for j in ids), 60, 0.2, "every job done")
        jobs = [client.get(f"/v1/jobs/{j}").get_json() for j in ids]
        assert [j["requeues"] for j in jobs] == [1, 0, 0, 0]
        assert jobs[0]["attempts"][0]["reason"] == "its message was lost"
    finally:
        pools.stop()


def _submit_when_redis_is_back(c) -> str:
    for _ in range(60):
        try:
            resp = c.post("/v1/jobs", json={"handler": "synthetic", "instances": [{"run_s": 0}],
                                            "n": 2})
            if resp.status_code == 202:
                return resp.get_json()["batch_id"]
        except redis.exceptions.ConnectionError:
            pass
        time.sleep(0.5)
    raise AssertionError("the API could not submit after the Redis restart")


def _restart_round(server, pools, c) -> None:
    server.restart(down_s=2.0)
    batch = _submit_when_redis_is_back(c)
    exited: dict[str, int] = {}

    def finished_or_exited() -> bool:
        for stage, proc in pools.procs.items():
            if proc.poll() is not None:
                exited[stage] = proc.returncode
        return bool(exited) or c.get(f"/v1/batches/{batch}").get_json()["complete"]

    wait_until(finished_or_exited, 90, 0.5, "jobs to finish, or a pool to exit")
    assert all(code != 0 for code in exited.values()), exited
    for stage in exited:  # what a supervisor does with a pool that failed
        pools.procs.pop(stage)
        pools.start(stage)
    wait_until(lambda: c.get(f"/v1/batches/{batch}").get_json()["complete"], 90, 0.5,
               "the batch submitted after the restart to finish")


def test_a_pool_survives_or_fails_loudly_across_a_redis_restart(tmp_path):
    """Restart Redis under running pools, twice: each pool either recovers (jobs submitted
    after the restart finish) or exits non-zero, so that a supervisor restarts it; never
    does one exit 0 and stay down."""
    from api import create_app
    from prorl_farm.config import load_settings
    from tests.farm import Pools

    server = RedisServer(tmp_path / "redis", appendonly=True)
    env = farm_env(server.url)
    pools = Pools(env, tmp_path)
    try:
        pools.start()
        app = create_app(load_settings(env))
        c = app.test_client()
        for _ in range(2):
            _restart_round(server, pools, c)
        app.extensions["prorl"].store.r.close()
    finally:
        pools.stop()
        server.stop()


def test_a_plain_celery_worker_on_several_queues_is_refused(redis_server, tmp_path):
    env = farm_env(redis_server.url)
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "prorl_farm.celery_app", "worker", "-I",
         "workers.run.tasks", "-Q",
         "init,run.testnode", "-P", "threads", "-c", "2", "--without-gossip",
         "--without-mingle", "--without-heartbeat", "-n", "plain@testnode"],
        env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=60)
    assert out.returncode != 0
    assert "exactly one farm queue" in out.stdout + out.stderr


def test_a_plain_celery_worker_on_one_queue_is_a_complete_pool(redis_server, r, tmp_path,
                                                               client):
    """Started as a plain `celery worker` on the init queue, the process heartbeats its pool
    and runs the reaper: a job past its deadline while queued elsewhere is failed on time."""
    env = farm_env(redis_server.url)
    log = open(tmp_path / "plain.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "prorl_farm.celery_app", "worker", "-I",
         "workers.init.tasks", "-Q", "init",
         "-P", "threads", "-c", "2", "--without-gossip", "--without-mingle",
         "--without-heartbeat", "-n", "plain@testnode"],
        env=env, cwd=ROOT, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        wait_until(lambda: r.zscore("prorl:pools", "init:testnode"), 30, 0.2, "pool heartbeat")
        # RUN has no pool: the job waits on run.testnode until its deadline, which only the
        # reaper (expire_deadlines) enforces.
        sub = client.post("/v1/jobs", json={"handler": "synthetic", "instances": [{}],
                                            "deadline_s": 2}).get_json()
        job = sub["job_ids"][0]
        wait_until(lambda: client.get(f"/v1/jobs/{job}").get_json()["state"] == "failed", 30,
                   0.2, "deadline enforced by the plain worker's reaper")
        assert client.get(f"/v1/jobs/{job}").get_json()["failure"]["kind"] == "timeout"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
