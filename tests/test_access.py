"""Access: the API token, the backend allow-list, Flower's auth off loopback, and the outside
network for sandboxes only where the operator allows it."""

from __future__ import annotations

import dataclasses

import pytest

from prorl_farm import keys
from prorl_farm.access import backend_url_refusal, parse_allow_list
from prorl_farm.config import load_settings
from prorl_farm.errors import ConfigError
from prorl_farm.redisconn import endpoints
from tests.farm import farm_env

TOKEN = "s3cret-token"
SUBMIT = {"handler": "synthetic", "instances": [{"run_s": 0}], "n": 2}


@pytest.fixture
def guarded(settings, r):
    """An API with an operator key: every call but the probes needs it."""
    from api import create_app

    return create_app(dataclasses.replace(settings, api_token=TOKEN)).test_client()


def _auth(token: str = TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _farm_keys(r) -> list[str]:
    """Every farm key but the count of refusals per address (api/access.py)."""
    return sorted(k for k in r.scan_iter("prorl:*") if not k.startswith("prorl:denials:"))


@pytest.mark.parametrize("headers", [{}, _auth("wrong"), {"Authorization": TOKEN},
                                     {"Authorization": f"Basic {TOKEN}"}])
def test_mutating_calls_need_the_token_and_leave_nothing_without_it(guarded, r, headers):
    before = _farm_keys(r)
    for method, path, body in (("post", "/v1/jobs", SUBMIT),
                               ("post", "/v1/backends", {"url": "http://127.0.0.1:9",
                                                         "kind": "vllm", "model": "m",
                                                         "tokenizer": "t"}),
                               ("post", "/v1/batches/b1/cancel", None),
                               ("delete", "/v1/backends/x", None)):
        resp = getattr(guarded, method)(path, json=body, headers=headers)
        assert resp.status_code == 401, (path, resp.get_json())
        assert resp.get_json()["error"]["code"] == "unauthorized"
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert _farm_keys(r) == before  # nothing written


def test_the_token_admits_and_reads_need_it_too(guarded, r):
    resp = guarded.post("/v1/jobs", json=SUBMIT, headers=_auth())
    assert resp.status_code == 202, resp.get_json()
    batch = resp.get_json()["batch_id"]
    assert guarded.get(f"/v1/batches/{batch}").status_code == 401
    assert guarded.get("/metrics").status_code == 401
    assert guarded.get(f"/v1/batches/{batch}", headers=_auth()).status_code == 200
    assert guarded.get("/metrics", headers=_auth()).status_code == 200
    assert guarded.get("/healthz").status_code == 200  # probes never need it
    assert guarded.get("/readyz").status_code != 401


def test_backend_urls_outside_the_allow_list_are_refused_with_the_rule(client, r,
                                                                        redis_server,
                                                                        tokenizer):
    spec = {"kind": "vllm", "model": "m", "tokenizer": tokenizer}
    resp = client.post("/v1/backends", json={"url": "http://10.1.2.3:8000", **spec})
    assert resp.status_code == 403
    error = resp.get_json()["error"]
    assert error["code"] == "backend_not_allowed"
    assert "allow-list" in error["details"]["url"][0]
    assert "PRORL_BACKEND_ALLOW" in error["message"]
    port = redis_server.url.rsplit(":", 1)[1].split("/")[0]
    for host in ("127.0.0.1", "localhost"):  # never the farm's own Redis, by any name
        resp = client.post("/v1/backends", json={"url": f"http://{host}:{port}/v1", **spec})
        assert resp.status_code == 403 and "Redis" in resp.get_json()["error"]["message"]
    assert client.get("/v1/backends").get_json()["backends"] == []
    assert client.post("/v1/backends", json={"url": "http://127.0.0.1:9", **spec}
                       ).status_code == 201  # loopback, not Redis: allowed (unhealthy)


def test_allow_list_rules():
    allow = parse_allow_list("10.0.0.0/8, gpu-node-3, 192.168.1.7")
    assert backend_url_refusal("http://10.9.8.7:8000", allow, []) is None
    assert backend_url_refusal("http://192.168.1.7", allow, []) is None
    assert "allow-list" in backend_url_refusal("http://192.168.1.8", allow, [])
    assert backend_url_refusal("http://gpu-node-3:8000", allow, []) is None  # named
    assert backend_url_refusal("http://[::1]:8000", allow, []) is None
    assert "allow-list" in backend_url_refusal("http://172.16.0.1", parse_allow_list(""),
                                               [])
    # A name is judged by every address it resolves to.
    assert backend_url_refusal("http://localhost:8000", parse_allow_list(""), []) is None
    assert "Redis" in backend_url_refusal("http://localhost:6379", allow,
                                          endpoints("redis://127.0.0.1:6379/0"))
    # A Sentinel service: its sentinels are the farm's Redis too.
    sentinels = endpoints("redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/prorl/0")
    assert sentinels == [("127.0.0.1", 26379), ("127.0.0.1", 26380)]
    assert "Redis" in backend_url_refusal("http://localhost:26380", allow, sentinels)
    # A port out of range is said to be that, not a host that does not resolve.
    for port in ("99999", "0"):
        assert backend_url_refusal(f"http://localhost:{port}", allow, []) == \
            "the port is not a number from 1 to 65535"
    with pytest.raises(ConfigError, match="PRORL_BACKEND_ALLOW"):
        load_settings(farm_env("redis://127.0.0.1:1", backend_allow="10.0.0.0/8,not a host"))


def test_outside_network_only_where_the_operator_allows_it(client, r, settings):
    from api import create_app

    body = {"handler": "shell", "instances": [{"commands": ["true"]},
                                              {"commands": ["true"], "network": True}]}
    resp = client.post("/v1/jobs", json=body)
    assert resp.status_code == 400
    details = resp.get_json()["error"]["details"]
    assert list(details["instances"]) == ["1"] and "PRORL_SANDBOX_NETWORK" in str(details)
    assert not r.exists(keys.BATCHES)  # nothing half-enqueued

    allowed = create_app(dataclasses.replace(settings, sandbox_network=True)).test_client()
    assert allowed.post("/v1/jobs", json=body).status_code == 202


def test_sandbox_manager_refuses_the_network_when_not_allowed(r, tmp_path):
    from prorl_farm.errors import SandboxError
    from prorl_farm.sandbox.abstract import SandboxSpec
    from prorl_farm.sandbox.manager import SandboxManager

    m = SandboxManager(r, "netnode", "local", root=str(tmp_path / "sbx"), allow_network=False)
    with pytest.raises(SandboxError, match="PRORL_SANDBOX_NETWORK"):
        m.start(SandboxSpec(network=True))
    assert m.records() == [] and list((tmp_path / "sbx").iterdir()) == []


def test_off_loopback_up_makes_up_a_token_and_puts_flower_behind_basic_auth():
    from prorl_farm.supervisor import Supervisor

    env = farm_env("redis://127.0.0.1:1")
    local = Supervisor(load_settings(env))
    local._plan()
    flower = next(c for c in local.children if c.name == "flower")
    assert local.settings.api_token == "" and flower.env == {"FLOWER_UNAUTHENTICATED_API": "1"}

    exposed = Supervisor(load_settings(env, api_host="0.0.0.0"))
    exposed._plan()
    flower = next(c for c in exposed.children if c.name == "flower")
    assert len(exposed.settings.api_token) >= 24
    assert "FLOWER_UNAUTHENTICATED_API" not in flower.env
    user, _, password = flower.env["FLOWER_BASIC_AUTH"].partition(":")
    assert user and len(password) >= 16
    given = Supervisor(load_settings(env, api_host="0.0.0.0", api_token="mine",
                                     flower_basic_auth="ops:pw"))
    assert given.settings.api_token == "mine" and given.generated == []
    # Tenants' keys, even on loopback: an operator's key is made up, and Flower (every
    # tenant's tasks) is behind it.
    tenants = Supervisor(load_settings(
        env, tenants='{"a": {"token": "team-a-key-0123456789"}}'))
    tenants._plan()
    flower = next(c for c in tenants.children if c.name == "flower")
    assert flower.env == {"FLOWER_BASIC_AUTH": f"operator:{tenants.settings.api_token}"}


def test_flower_off_loopback_refuses_without_the_password(redis_server, tmp_path):
    """Flower as `up` starts it on a non-loopback address: every page and its API (which can
    revoke tasks and stop workers) need the basic-auth password."""
    import os
    import subprocess

    import requests

    from prorl_farm.supervisor import Supervisor
    from tests.farm import free_port, stop_process, wait_until

    port = free_port()
    sup = Supervisor(load_settings(farm_env(redis_server.url), api_host="0.0.0.0",
                                   flower_port=port))
    sup._plan()
    flower = next(c for c in sup.children if c.name == "flower")
    log = open(tmp_path / "flower.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(flower.argv, env={**os.environ, **farm_env(redis_server.url),
                                             **flower.env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return requests.get(base + "/healthcheck", timeout=2).ok
            except requests.RequestException:  # refused, or slow while it starts
                return False

        wait_until(up, 30, 0.2, "flower")
        user, _, password = flower.env["FLOWER_BASIC_AUTH"].partition(":")
        for path in ("/", "/workers", "/api/workers", "/api/tasks"):
            assert requests.get(base + path, timeout=10).status_code == 401, path
            assert requests.get(base + path, auth=(user, "wrong"), timeout=10
                                ).status_code == 401, path
        assert requests.post(base + "/api/worker/shutdown/x", timeout=10).status_code in (
            401, 403)
        assert requests.get(base + "/workers", auth=(user, password), timeout=10).ok
    finally:
        stop_process(proc)
        log.close()


def test_the_openapi_document_states_the_network_rule(settings, r):
    from api import create_app

    def network(s) -> dict:
        doc = create_app(s).test_client().get("/openapi.json").get_json()
        shell = next(v for v in doc["components"]["schemas"]["Submit"]["oneOf"]
                     if v["properties"]["handler"]["enum"] == ["shell"] and "instance" in
                     v["properties"])
        return shell["properties"]["instance"]["properties"]["network"]

    assert network(settings)["enum"] == [False]
    assert "enum" not in network(dataclasses.replace(settings, sandbox_network=True))
