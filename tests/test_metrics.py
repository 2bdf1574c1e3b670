"""/metrics: the Prometheus exposition through prometheus_client, counted by real pools."""

from __future__ import annotations

import pytest

from tests.farm import scrape, wait_until
from tests.policy_server import PolicyServer

pytestmark = pytest.mark.slow


def _value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def _run(client, body: dict) -> dict:
    resp = client.post("/v1/jobs", json=body)
    assert resp.status_code == 202, resp.get_json()
    batch = resp.get_json()["batch_id"]
    return wait_until(lambda: (s := client.get(f"/v1/batches/{batch}").get_json())["complete"]
                      and s, 60, 0.1, "batch")


def test_metrics_count_jobs_stages_failures_sandboxes_backends_and_requests(pools, app, client,
                                                                           r, tokenizer):
    app.extensions["prorl"].latency.flush_s = 0.0  # every request reaches Redis at once
    server = PolicyServer()
    try:
        resp = client.post("/v1/backends", json={"url": server.url, "kind": "vllm",
                                                 "model": "m", "tokenizer": tokenizer,
                                                 "capacity": 4, "policy_version": 7})
        assert resp.status_code == 201
        backend = resp.get_json()["id"]
        _run(client, {"handler": "synthetic", "n": 3, "instances": [
            {"run_s": 0.2}, {"fail_stage": "eval"}, {"fail_stage": "run"}]})
        _run(client, {"handler": "shell", "instances": [{"commands": ["echo hi"]}]})
        m = scrape(client)
    finally:
        server.kill()

    assert _value(m, "prorl_jobs_finished_total", state="done") == 4
    assert _value(m, "prorl_jobs_finished_total", state="failed") == 6
    assert _value(m, "prorl_jobs_failed_total", kind="eval_error") == 3
    assert _value(m, "prorl_jobs_failed_total", kind="run_error") == 3
    for state in ("queued", "init", "run", "eval"):
        assert _value(m, "prorl_jobs", state=state) == 0
    # Every job waited for and ran INIT; RUN: all but none failed earlier; EVAL: 4 + 3.
    for stage, n in (("init", 10), ("run", 10), ("eval", 7)):
        assert _value(m, "prorl_stage_wait_seconds_count", stage=stage) == n, stage
        assert _value(m, "prorl_stage_active_seconds_count", stage=stage) == n, stage
        assert _value(m, "prorl_stage_active_seconds_bucket", stage=stage, le="+Inf") == n
    # Three RUN stages slept 0.2 s each.
    assert _value(m, "prorl_stage_active_seconds_sum", stage="run") >= 0.6
    assert _value(m, "prorl_stage_active_seconds_bucket", stage="run", le="0.1") <= 7
    assert _value(m, "prorl_sandboxes_started_total", node="testnode") >= 1
    assert _value(m, "prorl_sandboxes_live", node="testnode") == 0
    assert _value(m, "prorl_backend_capacity", backend=backend, model="m") == 4
    assert _value(m, "prorl_backend_policy_version", backend=backend, model="m") == 7
    assert _value(m, "prorl_backend_in_flight", backend=backend, model="m") == 0
    assert _value(m, "prorl_backend_healthy", backend=backend, model="m") == 1
    assert _value(m, "prorl_api_request_seconds_count", method="POST", route="/v1/jobs") == 2
    assert _value(m, "prorl_api_request_seconds_count", method="GET",
                  route="/v1/batches/<batch_id>") >= 2
    assert _value(m, "prorl_queue_depth", queue="init") == 0
    assert ("prorl_pool_heartbeat_age_seconds", (("node", "testnode"), ("stage", "run"))) in m
