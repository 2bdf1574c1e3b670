"""End to end through real Celery worker pools: throughput of many jobs, failures per stage,
result streams with cursors, redelivered messages, deadlines."""

from __future__ import annotations

import time

import pytest

from prorl_farm.celery_app import TASK_NAMES
from tests.farm import wait_until

pytestmark = pytest.mark.slow


def submit(client, instances, n=1, **kw):
    resp = client.post("/v1/jobs", json={"handler": "synthetic", "instances": instances, "n": n,
                                         **kw})
    assert resp.status_code == 202, resp.get_json()
    return resp.get_json()


def wait_batch(client, batch_id, timeout_s=60):
    return wait_until(
        lambda: (s := client.get(f"/v1/batches/{batch_id}").get_json())["complete"] and s,
        timeout_s, 0.1, f"batch {batch_id}")


def all_results(client, batch_id, limit):
    cursor, out = "0-0", []
    while True:
        page = client.get(f"/v1/batches/{batch_id}/results?cursor={cursor}&limit={limit}")
        page = page.get_json()
        if not page["results"]:
            return out, cursor
        assert len(page["results"]) <= limit
        out += page["results"]
        cursor = page["cursor"]


def test_300_jobs_across_batches_all_finish(pools, client, r):
    # Mixed outcomes: every 10th instance fails in one of the stages.
    batches = []
    for b in range(3):
        instances = [{"init_s": 0.01, "run_s": 0.05, "eval_s": 0.01, "reward": i % 2,
                      "fail_stage": (["init", "run", "eval"][i % 3] if i % 10 == 0 else None)}
                     for i in range(50)]
        batches.append((submit(client, instances, n=2, batch_id=f"big{b}"), instances))
    for sub, instances in batches:
        summary = wait_batch(client, sub["batch_id"])
        failing = sum(1 for x in instances if x["fail_stage"]) * 2
        assert summary["total"] == 100
        assert summary["counts"]["done"] == 100 - failing
        assert summary["counts"]["failed"] == failing
        assert sum(summary["counts"].values()) == 100
        results, _ = all_results(client, sub["batch_id"], limit=7)
        assert sorted(j["id"] for j in results) == sorted(sub["job_ids"])
        finished = [j["finished_at"] for j in results]
        assert finished == sorted(finished), "stream must give jobs in the order they finished"
        by_state = {j["id"]: j for j in results}
        for j in by_state.values():
            inst = instances[j["instance_index"]]
            if inst["fail_stage"]:
                assert j["state"] == "failed" and j["reward"] is None and j["filtered"]
                assert j["failure"]["kind"] == f"{inst['fail_stage']}_error"
            else:
                assert j["state"] == "done" and j["reward"] == inst["reward"]
                assert set(j["timings"]) == {"init", "run", "eval", "total_s"}
    # Nothing left in flight anywhere.
    assert r.zcard("prorl:active") == 0
    assert all(r.zcard(f"prorl:queued:{q}") == 0 for q in r.smembers("prorl:queues"))


def test_failure_in_each_stage_leaves_the_batch_unaffected(pools, client):
    instances = [{"run_s": 0.05}, {"fail_stage": "init"}, {"run_s": 0.05},
                 {"fail_stage": "run"}, {"fail_stage": "eval"}, {"reward": 0.25}]
    sub = submit(client, instances)
    wait_batch(client, sub["batch_id"])
    jobs = [client.get(f"/v1/jobs/{i}").get_json() for i in sub["job_ids"]]
    assert [j["state"] for j in jobs] == ["done", "failed", "done", "failed", "failed", "done"]
    assert [j["failure"]["kind"] for j in jobs if j["failure"]] == [
        "init_error", "run_error", "eval_error"]
    assert "synthetic failure in eval" in jobs[4]["failure"]["message"]
    assert jobs[5]["reward"] == 0.25
    # A failure is never a zero reward.
    assert all(j["reward"] is None for j in jobs if j["state"] == "failed")


def test_results_cursor_and_long_poll(pools, client):
    sub = submit(client, [{"run_s": 1.0}])
    t0 = time.monotonic()
    page = client.get(f"/v1/batches/{sub['batch_id']}/results?wait=20").get_json()
    assert [j["id"] for j in page["results"]] == sub["job_ids"]
    assert time.monotonic() - t0 < 15  # returned when the job finished, not at the wait limit
    assert page["complete"] and page["finished"] == page["total"] == 1
    t0 = time.monotonic()
    again = client.get(f"/v1/batches/{sub['batch_id']}/results?cursor={page['cursor']}&wait=20")
    assert again.get_json() == {"results": [], "cursor": page["cursor"], "complete": True,
                                "finished": 1, "total": 1}
    assert time.monotonic() - t0 < 5  # a complete batch has nothing to wait for


def test_long_poll_with_nothing_finishing_answers_empty_not_500(pools, client):
    """redis-py's default socket timeout once cut blocking reads at 5 s: a wait of 12 s (over
    twice that) with nothing finishing must answer 200 with no results at the wait's end."""
    sub = submit(client, [{"run_s": 30.0}])
    t0 = time.monotonic()
    resp = client.get(f"/v1/batches/{sub['batch_id']}/results?wait=12")
    waited = time.monotonic() - t0
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["results"] == [] and not resp.get_json()["complete"]
    assert waited >= 11.5
    client.post(f"/v1/batches/{sub['batch_id']}/cancel")


def test_redelivered_messages_are_no_ops(pools, client, r, settings):
    from prorl_farm.celery_app import create_celery_app

    sub = submit(client, [{"run_s": 1.5}])
    job_id = sub["job_ids"][0]
    wait_until(lambda: r.hget(f"prorl:job:{job_id}", "t_run_start"), 20, what="run started")
    celery = create_celery_app(settings)
    raw = r.hgetall(f"prorl:job:{job_id}")
    # The same RUN message again while it runs, and the INIT message that already ran.
    celery.send_task(TASK_NAMES["run"], args=[job_id, raw["token"]], queue="run.testnode")
    celery.send_task(TASK_NAMES["init"], args=[job_id, "an-old-token"], queue="init")
    wait_batch(client, sub["batch_id"])
    final = r.hgetall(f"prorl:job:{job_id}")
    assert final["t_run_start"] == raw["t_run_start"]
    assert final["t_init_start"] == raw["t_init_start"]
    # And a redelivery after the job is done changes nothing.
    celery.send_task(TASK_NAMES["eval"], args=[job_id, final["token"]], queue="eval.testnode")
    time.sleep(0.5)
    assert r.hgetall(f"prorl:job:{job_id}") == final
    summary = client.get(f"/v1/batches/{sub['batch_id']}").get_json()
    assert summary["counts"]["done"] == 1 and summary["total"] == 1


def test_deadline_fails_running_and_queued_jobs_with_timeout(pools, client):
    sub = submit(client, [{"run_s": 30}, {"init_s": 0.01}], deadline_s=1.0)
    wait_batch(client, sub["batch_id"], timeout_s=20)
    slow, fast = (client.get(f"/v1/jobs/{i}").get_json() for i in sub["job_ids"])
    assert slow["state"] == "failed" and slow["failure"]["kind"] == "timeout"
    assert slow["timings"]["run"]["active_s"] < 5
    assert fast["state"] == "done"
