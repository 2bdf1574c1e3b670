"""The fault suite: kill -9 of each pool mid-batch, and of Redis (restarted from its
append-only file), with LLM backends in use. Every job ends, none is lost or counted twice,
no backend slot stays held; the time to recover is printed. (An LLM backend killed
mid-batch: tests/test_backends.py::test_dead_backend_mid_batch_fails_over_or_fails_cleanly.)
"""

from __future__ import annotations

import signal
import time

import pytest
import redis

from prorl_farm import keys
from prorl_farm.llm.registry import BackendRegistry
from tests.farm import Pools, RedisServer, active_in, farm_env, wait_until
from tests.policy_server import PolicyServer

# kill -9 of pools and of Redis, with recovery times printed: on a machine of its own
pytestmark = [pytest.mark.slow, pytest.mark.serial]

SETTINGS = dict(heartbeat_stale_s=3, heartbeat_interval_s=0.2, reap_interval_s=0.5,
                max_requeues=3, run_concurrency=16, init_concurrency=8, eval_concurrency=8)
TERMINAL = ("done", "failed", "cancelled")


@pytest.fixture
def faulty(tmp_path, tokenizer):
    """Its own Redis (append-only, fsync always), pools, API client and two backends."""
    from api import create_app
    from prorl_farm.config import load_settings

    server = RedisServer(tmp_path / "redis", appendonly=True, fsync="always")
    env = farm_env(server.url, **SETTINGS)
    pools = Pools(env, tmp_path)
    backends = [PolicyServer(delay_s=0.02), PolicyServer(delay_s=0.02)]
    app = create_app(load_settings(env))
    client = app.test_client()
    try:
        pools.start()
        for b in backends:
            resp = client.post("/v1/backends", json={"url": b.url, "kind": "vllm",
                                                     "model": "m", "tokenizer": tokenizer,
                                                     "capacity": 16})
            assert resp.status_code == 201
        yield server, pools, client
    finally:
        pools.stop()
        for b in backends:
            b.kill()
        app.extensions["prorl"].store.r.close()
        server.stop()


def _submit(client, instances, n) -> dict:
    resp = client.post("/v1/jobs", json={"handler": "synthetic", "instances": instances,
                                         "n": n})
    assert resp.status_code == 202, resp.get_json()
    return resp.get_json()


def _check_exact(client, r, subs: list[dict]) -> list[dict]:
    """Every job terminal and done; each once in its batch's result stream; the batch
    counters, the farm's state counts and every backend's in-flight count agree."""
    jobs = []
    for sub in subs:
        summary = client.get(f"/v1/batches/{sub['batch_id']}").get_json()
        assert summary["complete"] and summary["counts"]["done"] == len(sub["job_ids"]), \
            summary
        assert sum(summary["counts"].values()) == summary["total"]
        stream = [f["job"] for _, f in r.xrange(keys.batch_stream(sub["batch_id"]))]
        assert sorted(stream) == sorted(sub["job_ids"]), "a job finished twice or never"
        jobs += [client.get(f"/v1/jobs/{i}").get_json() for i in sub["job_ids"]]
    assert all(j["state"] == "done" and j["reward"] == 1.0 for j in jobs)
    states = r.hgetall(keys.STATE_COUNTS)
    assert all(int(states.get(s, 0)) == 0 for s in ("queued", "init", "run", "eval"))
    assert set(BackendRegistry(r).in_flight().values()) <= {0}
    assert r.zcard(keys.ACTIVE) == 0
    return jobs


@pytest.mark.parametrize("stage", ["init", "run", "eval"])
def test_kill_9_of_a_pool_mid_batch(faulty, stage):
    server, pools, client = faulty
    r = redis.Redis.from_url(server.url, decode_responses=True)
    slow = {"init_s": 0.0, "run_s": 0.0, "eval_s": 0.0, stage + "_s": 2.0, "llm_turns": 2}
    sub = _submit(client, [slow], n=24)
    wait_until(lambda: len(active_in(r, sub["job_ids"], stage)) >= 4, 30,
               what=f"jobs active in {stage}")
    pools.pause(stage)  # what it holds, read exactly
    held = active_in(r, sub["job_ids"], stage)
    killed_at = float(r.time()[0]) + r.time()[1] / 1e6
    pools.kill(stage, signal.SIGKILL)
    time.sleep(0.5)
    pools.start(stage)  # what a supervisor does
    wait_until(lambda: client.get(f"/v1/batches/{sub['batch_id']}").get_json()["complete"],
               120, 0.2, "the batch")
    jobs = _check_exact(client, r, [sub])
    requeued = [j for j in jobs if j["id"] in held]
    assert all(j["requeues"] >= 1 for j in requeued)
    recovered = max(j["attempts"][0]["at"] for j in requeued) - killed_at
    print(f"\nkill -9 of the {stage} pool: {len(held)} held jobs re-queued within "
          f"{recovered:.1f} s (heartbeat stale time {SETTINGS['heartbeat_stale_s']} s)")
    r.close()


def test_kill_9_of_redis_mid_batch_and_restart_from_its_append_only_file(faulty):
    server, pools, client = faulty
    r = redis.Redis.from_url(server.url, decode_responses=True)
    subs = [_submit(client, [{"init_s": 0.05, "run_s": 0.5, "eval_s": 0.05, "llm_turns": 2}],
                    n=30) for _ in range(2)]
    wait_until(lambda: sum(client.get(f"/v1/batches/{s['batch_id']}").get_json()["finished"]
                           for s in subs) >= 5, 60, what="some progress")
    server.kill()
    t0 = time.monotonic()
    time.sleep(1.0)
    server.start()
    # Pools recover by themselves or exit non-zero; restart those that exited.
    end = time.monotonic() + 120
    while time.monotonic() < end:
        for stage, proc in list(pools.procs.items()):
            if proc.poll() is not None:
                assert proc.returncode != 0
                pools.procs.pop(stage)
                pools.start(stage, wait=False)
        try:
            if all(client.get(f"/v1/batches/{s['batch_id']}").get_json()["complete"]
                   for s in subs):
                break
        except redis.exceptions.ConnectionError:
            pass
        time.sleep(0.5)
    print(f"\nkill -9 of Redis: both batches complete {time.monotonic() - t0:.1f} s after")
    _check_exact(client, r, subs)
    r.close()


def test_a_wedged_pool_is_killed_by_its_watchdog_and_its_jobs_recovered(tmp_path):
    """A stage that holds the interpreter in a C call (the first attempt of one job) stops
    every thread of its pool, heartbeats included, while the process lives: the pool's
    watchdog kills it, a new pool starts (what a supervisor does), and every job, the
    wedging one and those that were running beside it, ends done."""
    from api import create_app
    from prorl_farm.config import load_settings

    server = RedisServer(tmp_path / "redis")
    env = farm_env(server.url, **{**SETTINGS, "watchdog_s": 2})
    pools = Pools(env, tmp_path)
    app = create_app(load_settings(env))
    client = app.test_client()
    r = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        pools.start()
        eval_pool = pools.procs["eval"]
        sub = _submit(client, [{"eval_s": 3.0}], n=4)
        wait_until(lambda: sum(1 for i in sub["job_ids"] if r.hget(keys.job(i), "state")
                               == "eval") == 4, 30, what="jobs in EVAL")
        wedged = _submit(client, [{"wedge_stage": "eval", "wedge_s": 600}], n=1)
        wait_until(lambda: eval_pool.poll() is not None, 30, 0.1, "the watchdog's kill")
        assert eval_pool.returncode == -signal.SIGKILL
        log = (tmp_path / "eval.log").read_text()
        assert "has not ticked for 2 s while alive (wedged); killing it" in log, log[-2000:]
        pools.procs.pop("eval")
        pools.start("eval")  # what a supervisor does
        for s in (sub, wedged):
            wait_until(lambda s=s: client.get(f"/v1/batches/{s['batch_id']}").get_json()[
                "complete"], 60, 0.2, "the batch")
        jobs = _check_exact(client, r, [sub, wedged])
        assert all(j["requeues"] == 1 for j in jobs), [j["requeues"] for j in jobs]
    finally:
        pools.stop()
        r.close()
        app.extensions["prorl"].store.r.close()  # as `faulty` does
        server.stop()

