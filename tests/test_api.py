"""API v1 against a real Redis (no workers): validation, 4xx errors, nothing enqueued."""

from __future__ import annotations

import json

import pytest

from tests.farm import open_slots

GOOD = {"handler": "synthetic", "instances": [{"run_s": 0.1}], "n": 2}


def _snapshot(r):
    """Everything a submission could have written: every key, and the init queue's length."""
    return sorted(r.keys("*")), r.llen("init")


BAD_REQUESTS = [
    # (id, body or raw bytes, content type, expected status, field or code that must be named)
    ("not-json", b"{nope", "application/json", 400, "invalid_json"),
    ("wrong-content-type", b"handler=synthetic", "application/x-www-form-urlencoded", 415,
     "unsupported_media_type"),
    ("array-body", [GOOD], None, 400, "body"),
    ("missing-handler", {"instances": [{}]}, None, 400, "handler"),
    ("unknown-handler", {**GOOD, "handler": "nope"}, None, 400, "handler"),
    ("missing-instances", {"handler": "synthetic"}, None, 400, "instances"),
    ("both-instance-and-instances", {**GOOD, "instance": {}}, None, 400, "instances"),
    ("instances-not-list", {**GOOD, "instances": {"run_s": 1}}, None, 400, "instances"),
    ("empty-instances", {**GOOD, "instances": []}, None, 400, "instances"),
    ("instance-not-object", {**GOOD, "instances": [{"run_s": 1}, 7]}, None, 400, "instances.1"),
    ("instance-wrong-type", {**GOOD, "instances": [{"run_s": "slow"}]}, None, 400,
     "instances.0.run_s"),
    ("instance-unknown-field", {**GOOD, "instances": [{"run_secs": 1}]}, None, 400,
     "instances.0.run_secs"),
    ("instance-bad-enum", {**GOOD, "instances": [{"fail_stage": "train"}]}, None, 400,
     "instances.0.fail_stage"),
    ("n-zero", {**GOOD, "n": 0}, None, 400, "n"),
    ("n-string", {**GOOD, "n": "2"}, None, 400, "n"),
    ("n-too-many-jobs", {**GOOD, "instances": [{}] * 100, "n": 200}, None, 400, "n"),
    ("sampling-wrong-type", {**GOOD, "sampling": {"temperature": "hot"}}, None, 400,
     "sampling.temperature"),
    ("sampling-unknown-field", {**GOOD, "sampling": {"temprature": 1.0}}, None, 400,
     "sampling.temprature"),
    ("deadline-negative", {**GOOD, "deadline_s": -1}, None, 400, "deadline_s"),
    ("batch-id-bad-chars", {**GOOD, "batch_id": "a/b"}, None, 400, "batch_id"),
    ("unknown-top-level-field", {**GOOD, "prio": 3}, None, 400, "prio"),
    ("priority-out-of-range", {**GOOD, "priority": 101}, None, 400, "priority"),
    ("priority-not-integer", {**GOOD, "priority": 1.5}, None, 400, "priority"),
]


@pytest.mark.parametrize("name,body,ctype,status,named", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_submit_is_rejected_and_enqueues_nothing(client, r, name, body, ctype, status,
                                                     named):
    before = _snapshot(r)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = client.post("/v1/jobs", data=data, content_type=ctype or "application/json")
    assert resp.status_code == status, resp.get_json()
    err = resp.get_json()["error"]
    assert set(err) == {"code", "message", "details"}
    assert named in err["code"] or named in err["message"], err
    assert _snapshot(r) == before


def test_oversized_body_is_413_and_enqueues_nothing(app, client, r):
    app.config["MAX_CONTENT_LENGTH"] = 10_000
    before = _snapshot(r)
    body = {**GOOD, "instances": [{"run_s": 0.1}] * 2000}
    resp = client.post("/v1/jobs", json=body)
    assert resp.status_code == 413
    assert resp.get_json()["error"]["code"] == "request_entity_too_large"
    assert _snapshot(r) == before


def test_one_bad_instance_rejects_the_whole_request(client, r):
    before = _snapshot(r)
    body = {**GOOD, "instances": [{"run_s": 0.1}] * 5 + [{"reward": "high"}]}
    resp = client.post("/v1/jobs", json=body)
    assert resp.status_code == 400
    assert resp.get_json()["error"]["details"] == {
        "instances": {"5": {"reward": ["Not a valid number."]}}}
    assert _snapshot(r) == before


@pytest.mark.parametrize("path", ["/v1/jobs/nope", "/v1/batches/nope",
                                  "/v1/batches/nope/results"])
def test_unknown_ids_are_404(client, path):
    resp = client.get(path)
    assert resp.status_code == 404
    assert resp.get_json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("path", ["/v1/jobs/nope/cancel", "/v1/batches/nope/cancel"])
def test_cancel_unknown_is_404(client, path):
    assert client.post(path).status_code == 404


def test_submit_writes_jobs_and_init_messages(client, r):
    open_slots(r)  # as a pool would: every message goes onto the queue
    resp = client.post("/v1/jobs", json={**GOOD, "batch_id": "b1", "deadline_s": 60})
    assert resp.status_code == 202
    body = resp.get_json()
    assert body["batch_id"] == "b1" and len(body["job_ids"]) == 2
    assert r.llen("init") == 2  # one Celery message each, nobody consuming
    job = client.get(f"/v1/jobs/{body['job_ids'][0]}").get_json()
    assert job["state"] == "queued" and job["stage"] == "init" and job["phase"] == "waiting"
    assert job["instance"]["run_s"] == 0.1 and job["reward"] is None
    assert job["deadline_at"] - job["created_at"] == pytest.approx(60, abs=1)
    summary = client.get("/v1/batches/b1").get_json()
    assert summary["total"] == 2 and summary["counts"]["queued"] == 2
    # The same batch id again adds to the batch.
    client.post("/v1/jobs", json={**GOOD, "n": 1, "batch_id": "b1"})
    assert client.get("/v1/batches/b1").get_json()["total"] == 3
    r.delete("init")


def test_a_retried_submit_with_its_idempotency_key_makes_no_second_batch(client, r):
    open_slots(r)
    first = client.post("/v1/jobs", json={**GOOD, "idempotency_key": "step-7"})
    assert first.status_code == 202
    again = client.post("/v1/jobs", json={**GOOD, "idempotency_key": "step-7"})
    assert again.status_code == 200
    assert again.get_json() == {**first.get_json(), "replayed": True}
    assert r.llen("init") == 2  # no second message, no second job
    # The header works the same; another body under a used key is a conflict.
    by_header = client.post("/v1/jobs", json=GOOD, headers={"Idempotency-Key": "step-7"})
    assert by_header.status_code == 200 and by_header.get_json()["replayed"]
    other = client.post("/v1/jobs", json={**GOOD, "n": 3, "idempotency_key": "step-7"})
    assert other.status_code == 409
    assert other.get_json()["error"]["code"] == "idempotency_conflict"
    assert r.llen("init") == 2
    assert client.post("/v1/jobs", json={**GOOD, "idempotency_key": "bad key!"}
                       ).status_code == 400
    r.delete("init")


def test_bad_results_query_is_400(client, r):
    batch = client.post("/v1/jobs", json=GOOD).get_json()["batch_id"]
    r.delete("init")
    for query, field in (("cursor=abc", "cursor"), ("limit=0", "limit"), ("wait=-1", "wait"),
                         ("limit=x", "limit"), ("colour=red", "colour"),
                         ("cursor=99999999999999999999999-0", "cursor"),
                         ("cursor=18446744073709551616-0", "cursor"), ("wait=nan", "wait")):
        resp = client.get(f"/v1/batches/{batch}/results?{query}")
        assert resp.status_code == 400, query
        assert field in resp.get_json()["error"]["message"]


def test_handlers_openapi_health(client, r):
    handlers = client.get("/v1/handlers").get_json()["handlers"]
    synthetic = next(h for h in handlers if h["name"] == "synthetic")
    assert "run_s" in synthetic["instance_schema"]["properties"]
    doc = client.get("/openapi.json").get_json()
    assert doc["openapi"].startswith("3.0.")
    # Every schema in it is OpenAPI 3.0's (no if/then, const or type lists, which 3.0 tools
    # would ignore or refuse): the document is valid per 3.0's own schema.
    from schemathesis.specs.openapi.definitions import OPENAPI_30_VALIDATOR

    errors = [f"{e.instance_path}: {str(e)[:300]}" for e in OPENAPI_30_VALIDATOR.iter_errors(doc)]
    assert not errors, errors
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/batches/{batch_id}/results"} <= set(doc["paths"])
    assert "Submit" in doc["components"]["schemas"]
    assert client.get("/healthz").status_code == 200
    # No pools run in this test; an earlier test's killed pools beat until they are stale
    # (the fixtures keep the heartbeats of pools a module shares): none are this test's.
    r.delete("prorl:pools")
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert ready.get_json()["missing_stages"] == ["init", "run", "eval"]


def test_wrong_method_is_json_405(client):
    resp = client.delete("/v1/jobs")
    assert resp.status_code == 405
    assert resp.get_json()["error"]["code"] == "method_not_allowed"


def test_hostile_bodies_get_a_4xx_fast_and_write_nothing(client, r):
    """Deep nesting, a million instances, and a 405 that names the allowed methods."""
    import time

    deep = b'{"handler": "synthetic", "instances": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}"
    resp = client.post("/v1/jobs", data=deep, content_type="application/json")
    assert resp.status_code == 400 and "nested" in resp.get_json()["error"]["message"]
    t0 = time.process_time()
    body = {"handler": "synthetic", "instances": [{}] * 1_000_000}
    resp = client.post("/v1/jobs", json=body)
    assert resp.status_code in (400, 413), resp.status_code
    assert time.process_time() - t0 < 30  # not a minute of validation per request
    if resp.status_code == 400:
        assert "instances" in resp.get_json()["error"]["message"]
    resp = client.post("/v1/jobs", json={"handler": "synthetic", "instances": [{}] * 3,
                                         "n": 4000})
    assert resp.status_code == 400 and "n" in resp.get_json()["error"]["details"]
    resp = client.delete("/v1/jobs")
    assert resp.status_code == 405 and "POST" in resp.headers["Allow"]
    assert resp.get_json()["error"]["code"] == "method_not_allowed"
    # Nothing but the API's own request-latency metrics (flushed in the background), and
    # the heartbeats and slots of pools an earlier test module may have left running.
    left = [k for k in r.scan_iter("prorl:*")
            if not k.startswith("prorl:metrics:") and k != "prorl:pools"
            and not (k.startswith("prorl:fair:") and k.endswith(":slots"))]
    assert not left, f"a rejected request wrote {left}"


def test_an_instance_is_stored_once_for_its_samples(client, r):
    big = {"run_s": 0.0, "payload": "x" * 100_000}
    resp = client.post("/v1/jobs", json={"handler": "synthetic", "instance": big, "n": 50})
    assert resp.status_code == 202
    used = sum(r.memory_usage(k) or 0 for k in r.scan_iter("prorl:job:*"))
    instances = list(r.scan_iter("prorl:instance:*"))
    assert len(instances) == 1
    job = client.get(f"/v1/jobs/{resp.get_json()['job_ids'][7]}").get_json()
    assert job["instance"]["payload"] == big["payload"] and job["sample_index"] == 7
    # No copy of the instance, nor of the sampling parameters, in each job hash: it stays
    # in Redis's compact encoding.
    assert used < 50 * 1000, used
    assert all(r.object("encoding", k) == "listpack" for k in r.scan_iter("prorl:job:*"))
    assert job["sampling"]["temperature"] == 1.0 and job["sampling"]["top_k"] == -1


def test_recent_batches_are_listed(client, r):
    a = client.post("/v1/jobs", json=GOOD).get_json()["batch_id"]
    b = client.post("/v1/jobs", json=GOOD).get_json()["batch_id"]
    listed = client.get("/v1/batches?limit=10").get_json()["batches"]
    assert [x["batch_id"] for x in listed][:2] == [b, a]
    assert listed[0]["total"] == listed[0]["counts"]["queued"] and not listed[0]["complete"]
    assert client.get("/v1/batches?limit=0").status_code == 400


def test_results_of_several_batches_in_one_read(client):
    """POST /v1/batches/results: each batch after its own cursor, in one request; a batch
    that is not stored comes back found: false; a bad cursor is a field-level 400."""
    a = client.post("/v1/jobs", json=GOOD).get_json()
    b = client.post("/v1/jobs", json=GOOD).get_json()
    client.post(f"/v1/batches/{a['batch_id']}/cancel")
    body = {"cursors": {a["batch_id"]: "0-0", b["batch_id"]: "0-0", "nope": "0-0"},
            "wait": 0.2}
    out = client.post("/v1/batches/results", json=body).get_json()["batches"]
    assert out["nope"] == {"found": False}
    pa, pb = out[a["batch_id"]], out[b["batch_id"]]
    assert sorted(j["id"] for j in pa["results"]) == sorted(a["job_ids"])
    assert {j["state"] for j in pa["results"]} == {"cancelled"} and pa["complete"]
    assert pb == {"found": True, "cursor": "0-0", "results": [], "complete": False,
                  "finished": 0, "total": 2}
    again = client.post("/v1/batches/results", json={
        "cursors": {a["batch_id"]: pa["cursor"]}}).get_json()["batches"]
    assert again[a["batch_id"]]["results"] == []  # nothing after its cursor
    bad = client.post("/v1/batches/results", json={"cursors": {a["batch_id"]: "x"}})
    assert bad.status_code == 400
    assert "cursors" in json.dumps(bad.get_json()["error"]["details"])
