"""Tenants are walls (docs/security.md): two tenants and the operator, every route of the
OpenAPI document tried with each key and with none, against a table of what each may do
that this test holds itself (a route the table does not name fails it, as does a Flask
route without an access rule). Tenant B's every try on tenant A's work is the very 404 an
unknown id gets, and changes nothing of A's; no key at all is a 401 but on the probes;
the farm's own surfaces are the operator's (403 for a tenant's key)."""

from __future__ import annotations

import json
import re

import pytest

from prorl_farm.config import load_settings
from prorl_farm.llm.registry import BackendRegistry, BackendSpec
from tests.farm import farm_env
from tests.policy_server import PolicyServer

OPERATOR = "operator-key-0123456789"
KEY_A, KEY_B = "team-a-key-0123456789", "team-b-key-0123456789"
TENANTS = {"team-a": {"token": KEY_A}, "team-b": {"token": KEY_B}}
UNKNOWN = "0" * 32

# (method, path) -> who may: open (anyone), key (any key; the answer is the caller's),
# owner (the batch's or job's tenant, or the operator), backend (the backend's tenant, or
# the operator), operator.
TABLE = {
    ("get", "/healthz"): "open",
    ("get", "/readyz"): "open",
    ("get", "/metrics"): "operator",
    ("post", "/v1/jobs"): "key",
    ("get", "/v1/jobs/{job_id}"): "owner",
    ("post", "/v1/jobs/{job_id}/cancel"): "owner",
    ("get", "/v1/batches"): "key",
    ("post", "/v1/batches/results"): "key",
    ("get", "/v1/batches/{batch_id}"): "owner",
    ("get", "/v1/batches/{batch_id}/results"): "owner",
    ("get", "/v1/batches/{batch_id}/stats"): "owner",
    ("post", "/v1/batches/{batch_id}/cancel"): "owner",
    ("post", "/v1/batches/{batch_id}/ack"): "owner",
    ("get", "/v1/overview"): "operator",
    ("get", "/v1/history"): "operator",
    ("get", "/v1/handlers"): "key",
    ("get", "/v1/tenants"): "key",
    ("post", "/v1/backends"): "key",
    ("get", "/v1/backends"): "key",
    ("post", "/v1/weights"): "key",
    ("get", "/v1/backends/{backend_id}"): "backend",
    ("delete", "/v1/backends/{backend_id}"): "backend",
    ("post", "/v1/backends/{backend_id}/drain"): "backend",
    ("post", "/v1/backends/{backend_id}/resume"): "backend",
    ("post", "/v1/backends/{backend_id}/weights"): "backend",
}
# Tried last by the allowed callers: they change what the others read.
LAST = {("delete", "/v1/backends/{backend_id}"), ("post", "/v1/batches/{batch_id}/cancel"),
        ("post", "/v1/jobs/{job_id}/cancel")}


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
def walls(redis_server, r, tokenizer):
    from api import create_app

    settings = load_settings(farm_env(redis_server.url, api_token=OPERATOR,
                                      tenants=json.dumps(TENANTS), tenant_loopback="1"))
    app = create_app(settings)
    client = app.test_client()
    sub = client.post("/v1/jobs", headers=_auth(KEY_A), json={
        "handler": "synthetic", "instances": [{"run_s": 0}], "n": 2}).get_json()
    backend = BackendRegistry(r).register(BackendSpec("http://127.0.0.1:9", "vllm", "m",
                                                      tokenizer, capacity=4,
                                                      tenant="team-a"))
    ids = {"batch_id": sub["batch_id"], "job_id": sub["job_ids"][0], "backend_id": backend}
    yield client, ids, tokenizer
    app.extensions["prorl"].close()


def _call(client, method, path, ids, key, tokenizer, unknown=False):
    filled = path
    for name, value in ids.items():
        filled = filled.replace("{" + name + "}", UNKNOWN if unknown else value)
    body = {
        ("post", "/v1/jobs"): {"handler": "synthetic", "instances": [{"run_s": 0}]},
        ("post", "/v1/batches/results"): {"cursors": {ids["batch_id"]: "0-0"}, "wait": 0},
        ("post", "/v1/backends"): {"url": "http://127.0.0.1:9", "kind": "vllm",
                                   "model": "m", "tokenizer": tokenizer},
        ("post", "/v1/backends/{backend_id}/resume"): {"policy_version": 0},
        ("post", "/v1/backends/{backend_id}/weights"): {"path": "/nonexistent",
                                                        "policy_version": 1},
        ("post", "/v1/weights"): {"path": "/nonexistent", "policy_version": 1},
    }.get((method, path))
    query = "?wait=0" if path.endswith("/results") and method == "get" else ""
    return getattr(client, method)(filled + query, headers=_auth(key),
                                   **({"json": body} if body is not None else {}))


def _a_view(client, ids) -> dict:
    """What A's work looks like to A: its batch, its jobs, its backends."""
    a = _auth(KEY_A)
    return {"batch": client.get(f"/v1/batches/{ids['batch_id']}", headers=a).get_json(),
            "job": client.get(f"/v1/jobs/{ids['job_id']}", headers=a).get_json()["state"],
            "backends": client.get("/v1/backends", headers=a).get_json()}


def test_every_route_with_every_key_and_none(walls, r):
    client, ids, tokenizer = walls
    doc = client.get("/openapi.json", headers=_auth(KEY_B)).get_json()
    assert "team-a" not in json.dumps(doc)
    routes = [(m, p) for p, ops in doc["paths"].items() for m in ops]
    assert set(routes) == set(TABLE), ("routes without a rule in this test's table, or "
                                       f"gone: {set(routes) ^ set(TABLE)}")
    for method, path in routes:  # the document says the rule the farm applies
        assert doc["paths"][path][method]["x-prorl-access"] == TABLE[(method, path)]
    before = _a_view(client, ids)
    # No key, and tenant B's: nothing of A's is reached, nothing changes.
    for method, path in routes:
        rule = TABLE[(method, path)]
        got = _call(client, method, path, ids, None, tokenizer)
        assert (got.status_code == 401) == (rule != "open"), (method, path, got.status_code)
        got = _call(client, method, path, ids, KEY_B, tokenizer)
        if rule == "operator":
            assert got.status_code == 403, (method, path, got.get_json())
        elif rule in ("owner", "backend"):
            unknown = _call(client, method, path, ids, KEY_B, tokenizer, unknown=True)
            assert got.status_code == unknown.status_code == 404, (method, path)
            seen = json.dumps(got.get_json())
            for name in ("batch_id", "job_id", "backend_id"):
                seen = seen.replace(ids[name], UNKNOWN)
            assert seen == json.dumps(unknown.get_json()), (method, path)
        else:
            assert got.status_code not in (401, 403), (method, path, got.get_json())
            text = got.get_data(as_text=True)
            if path == "/v1/batches/results":  # asked of A's batch: not stored, for B
                assert got.get_json()["batches"] == {ids["batch_id"]: {"found": False}}
            else:
                for theirs in (ids["batch_id"], ids["job_id"], ids["backend_id"], "team-a"):
                    assert theirs not in text, (path, theirs, text)
    assert _a_view(client, ids) == before
    # A and the operator: allowed where the table says (what they send may still be
    # refused for what it is: a 400, a 409; never for who sends it).
    for key in (KEY_A, OPERATOR):
        if key == OPERATOR:  # A removed its backend last: another of A's for the operator
            ids["backend_id"] = BackendRegistry(r).register(BackendSpec(
                "http://127.0.0.1:9", "vllm", "m", tokenizer, tenant="team-a"))
        for method, path in sorted(routes, key=lambda mp: mp in LAST):
            rule = TABLE[(method, path)]
            if rule == "operator" and key != OPERATOR:
                continue
            if path == "/v1/weights":  # a backend of theirs that loads nothing: 404 or 422
                continue
            got = _call(client, method, path, ids, key, tokenizer)
            assert got.status_code not in (401, 403, 404), (key, method, path, got.get_json())


def test_lists_and_many_results_hold_only_what_the_key_may_see(walls):
    client, ids, _ = walls
    # One of A's jobs ends (cancelled): it is on A's results stream from now on.
    assert client.post(f"/v1/jobs/{ids['job_id']}/cancel",
                       headers=_auth(KEY_A)).status_code == 200
    b_sub = client.post("/v1/jobs", headers=_auth(KEY_B), json={
        "handler": "synthetic", "instances": [{"run_s": 0}]}).get_json()
    seen = {key: {b["batch_id"] for b in client.get("/v1/batches", headers=_auth(key))
                  .get_json()["batches"]} for key in (KEY_A, KEY_B, OPERATOR)}
    assert seen[KEY_A] == {ids["batch_id"]} and seen[KEY_B] == {b_sub["batch_id"]}
    assert seen[OPERATOR] == {ids["batch_id"], b_sub["batch_id"]}
    many = client.post("/v1/batches/results", headers=_auth(KEY_B), json={
        "cursors": {ids["batch_id"]: "0-0", b_sub["batch_id"]: "0-0"}, "wait": 0}).get_json()
    assert many["batches"][ids["batch_id"]] == {"found": False}
    assert many["batches"][b_sub["batch_id"]]["found"] is True
    # The same read as Arrow pages: nothing of A's job in them; A reads it.
    arrow = {"Accept": "application/vnd.apache.arrow.stream"}
    for key, has in ((KEY_B, False), (KEY_A, True)):
        page = client.post("/v1/batches/results", headers={**_auth(key), **arrow}, json={
            "cursors": {ids["batch_id"]: "0-0"}, "wait": 0})
        assert page.status_code == 200 and page.mimetype == arrow["Accept"]
        assert (ids["job_id"].encode() in page.data) == has, key
    assert client.get(f"/v1/batches/{ids['batch_id']}/results?wait=0",
                      headers={**_auth(KEY_B), **arrow}).status_code == 404
    tenants = client.get("/v1/tenants", headers=_auth(KEY_B)).get_json()
    assert [t["tenant"] for t in tenants["tenants"]] == ["team-b"]
    assert "team-a" not in json.dumps(tenants["fair_share"])


def test_a_flood_of_refusals_is_slowed_per_key(redis_server, r):
    """Past PRORL_API_DENIALS_PER_MIN refusals (401, 404) within a minute, a caller is
    answered 429 with Retry-After instead; its allowed calls are not counted. A
    caller is its key (an address without one): B's flood of refusals, and a keyless one
    from the same address, leave A's limit whole."""
    from api import create_app

    app = create_app(load_settings(farm_env(redis_server.url, api_token=OPERATOR,
                                            tenants=json.dumps(TENANTS),
                                            api_denials_per_min=5)))
    client = app.test_client()
    try:
        for _ in range(10):
            assert client.get("/v1/handlers", headers=_auth(KEY_A)).status_code == 200
        codes = [client.get(f"/v1/batches/{i:032x}", headers=_auth(KEY_B)).status_code
                 for i in range(8)]
        assert codes == [404] * 5 + [429] * 3
        slowed = client.get(f"/v1/batches/{9:032x}", headers=_auth(KEY_B))
        assert slowed.status_code == 429 and int(slowed.headers["Retry-After"]) > 0
        assert [client.get("/v1/batches").status_code for _ in range(7)] == \
            [401] * 5 + [429] * 2
        # A, from the same address, has its own limit: its unknown id is a 404.
        assert client.get(f"/v1/batches/{0:032x}", headers=_auth(KEY_A)).status_code == 404
        assert client.get("/v1/batches", headers=_auth(KEY_A)).status_code == 200
    finally:
        app.extensions["prorl"].close()


def test_every_flask_route_has_an_access_rule(settings):
    from api import create_app
    from api.access import RULES

    app = create_app(settings)
    try:
        endpoints = {rule.endpoint for rule in app.url_map.iter_rules()}
        assert endpoints <= set(RULES), endpoints - set(RULES)
    finally:
        app.extensions["prorl"].close()


def test_the_gym_server_off_loopback_needs_a_farm_with_keys(redis_server):
    """Off loopback, the Gym agent server refuses to start for a farm without keys (it
    would run anyone's rows); with keys it asks its callers for theirs
    (tests/test_spaces.py)."""
    import asyncio

    from prorl_farm.errors import ConfigError
    from prorl_farm.gym.server import serve
    from tests.farm import free_port

    with pytest.raises(ConfigError, match="not loopback"):
        asyncio.run(serve("0.0.0.0", free_port(), "http://127.0.0.1:9", api_token=""))


def test_ids_carry_128_random_bits():
    from prorl_farm.jobs.store import new_id

    ids = {new_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


def test_the_api_off_loopback_refuses_to_start_without_a_key():
    import os
    import subprocess
    import sys

    from tests.farm import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    env.update(PRORL_REDIS_URL="redis://127.0.0.1:1/0", PRORL_API_HOST="0.0.0.0")
    out = subprocess.run([sys.executable, "-m", "prorl_farm.cli", "api"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not loopback" in out.stderr, out


def test_a_tenants_jobs_go_to_its_own_backends_only(walls, r):
    """Each tenant registers its own backends with its own key (the servers of its own
    policy); a job is pinned only to a backend of its tenant: B's prompts never reach A's
    server, whatever the load, and a tenant with no backend of its own gets none."""
    client, ids, tokenizer = walls
    registry = BackendRegistry(r)
    b_job = client.post("/v1/jobs", headers=_auth(KEY_B), json={
        "handler": "synthetic", "instances": [{"run_s": 0}], "n": 3}).get_json()["job_ids"]
    assert [registry.acquire(j) for j in b_job] == [None] * 3  # only A has one
    assert registry.acquire(ids["job_id"]) == ids["backend_id"]
    # B registers its own, with its own key (not A's name: 403; the operator may).
    engine = PolicyServer()
    spec = {"url": engine.url, "kind": "vllm", "model": "m", "tokenizer": tokenizer,
            "capacity": 64}
    assert client.post("/v1/backends", headers=_auth(KEY_B),
                       json={**spec, "tenant": "team-a"}).status_code == 403
    mine = client.post("/v1/backends", headers=_auth(KEY_B), json=spec)
    engine.kill()
    assert mine.status_code == 201 and mine.get_json()["tenant"] == "team-b"
    b_backend = mine.get_json()["id"]
    assert {registry.acquire(j) for j in b_job} == {b_backend}
    # A's backend is the least loaded by far, and still takes none of B's.
    assert registry.get(ids["backend_id"])["in_flight"] == 1
    assert registry.get(b_backend)["in_flight"] == 3
    # The heaps as the scripts keep them are where keys.backend_heap says.
    assert registry.get(b_backend)["in_heap"] and registry.get(ids["backend_id"])["in_heap"]
    assert r.zscore("prorl:backends:heap:team-b", b_backend) is not None
    listed = {key: [b["id"] for b in client.get("/v1/backends", headers=_auth(key))
                    .get_json()["backends"]] for key in (KEY_A, KEY_B, OPERATOR)}
    assert listed == {KEY_A: [ids["backend_id"]], KEY_B: [b_backend],
                      OPERATOR: sorted([ids["backend_id"], b_backend])}
    # The operator registers for a tenant by naming it (an engine of A's: B's is B's).
    ops = client.post("/v1/backends", headers=_auth(OPERATOR), json={
        **spec, "url": "http://127.0.0.1:9", "tenant": "team-a"})
    assert ops.status_code == 201 and ops.get_json()["tenant"] == "team-a"
