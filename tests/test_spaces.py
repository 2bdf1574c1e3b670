"""Tenants own their spaces (docs/security.md, "Tenants are walls"): each attack on a space
two tenants used to share, tried as the other tenant would. Batch ids: a race into one
client id, an id reused after its batch expired, a write to a batch's record; engines: B
registers A's engine under every spelling of its URL, and probes the host's listeners
through registration; oracles: what B can learn of A's ids and tenants. Against a real
Redis and real HTTP servers (the engines are scripted policy servers)."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from prorl_farm import keys
from prorl_farm.config import load_settings
from prorl_farm.dev.devserver import ModelHTTPServer, send_body
from prorl_farm.llm.registry import BackendRegistry
from tests.farm import farm_env, free_port
from tests.policy_server import PolicyServer

OPERATOR = "operator-key-0123456789"
KEY_A, KEY_B = "team-a-key-0123456789", "team-b-key-0123456789"
TENANTS = {"team-a": {"token": KEY_A}, "team-b": {"token": KEY_B, "max_queued": 5}}


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture
def farm(redis_server, r):
    from api import create_app

    app = create_app(load_settings(farm_env(redis_server.url, api_token=OPERATOR,
                                            tenants=json.dumps(TENANTS),
                                            tenant_loopback="1")))
    yield app
    app.extensions["prorl"].close()


def _submit(client, key, n=1, **body):
    return client.post("/v1/jobs", headers=_auth(key), json={
        "handler": "synthetic", "instances": [{"run_s": 0}], "n": n, **body})


def _side_by_side(*calls) -> list:
    """Run each call in a thread of its own, all let go at the same moment; their results."""
    out: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i, call):
        start.wait()
        out[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# -- batch ids --------------------------------------------------------------------------


def test_a_race_into_one_client_batch_id_makes_two_batches_every_time(farm, r):
    """A submits 400 jobs into id X while B submits 1 into X at the same moment, 25 times
    over: each time both get 202, A's batch holds A's 400 jobs only, B's its 1, and B's
    cancel of X ends its own job only."""
    for i in range(25):
        given = f"race-{i}"
        a_sub, b_sub = _side_by_side(
            lambda: _submit(farm.test_client(), KEY_A, n=400, batch_id=given),  # noqa: B023
            lambda: _submit(farm.test_client(), KEY_B, n=1, batch_id=given))  # noqa: B023
        out = {KEY_A: a_sub, KEY_B: b_sub}
        assert out[KEY_A].status_code == out[KEY_B].status_code == 202
        client = farm.test_client()
        a = client.get(f"/v1/batches/{given}", headers=_auth(KEY_A)).get_json()
        b = client.get(f"/v1/batches/{given}", headers=_auth(KEY_B)).get_json()
        assert (a["tenant"], a["total"], b["tenant"], b["total"]) == \
            ("team-a", 400, "team-b", 1)
        assert set(r.lrange(keys.batch_jobs(f"team-a:{given}"), 0, -1)) == \
            set(out[KEY_A].get_json()["job_ids"])
        # B's cancel of "its" X ends its job only; A's are untouched.
        assert client.post(f"/v1/batches/{given}/cancel",
                           headers=_auth(KEY_B)).get_json()["cancelled"] == 1
        assert client.get(f"/v1/batches/{given}", headers=_auth(KEY_A)
                          ).get_json()["counts"]["queued"] == 400
        client.post(f"/v1/batches/{given}/cancel", headers=_auth(KEY_A))


def test_an_id_reused_after_its_batch_expired_is_the_new_tenants_alone(farm, r):
    """B's batch step-0001 expires; A takes the id: accepted at once (no ghost of B's), and
    B's key reads nothing of A's, however many API processes cached what."""
    other = farm.test_client()
    client = farm.test_client()
    assert _submit(client, KEY_B, batch_id="step-0001").status_code == 202
    assert other.get("/v1/batches/step-0001", headers=_auth(KEY_B)).status_code == 200
    for k in list(r.scan_iter("prorl:batch:team-b:step-0001*")):  # expired, as by TTL
        r.delete(k)
    sub = _submit(client, KEY_A, batch_id="step-0001")
    assert sub.status_code == 202
    job = sub.get_json()["job_ids"][0]
    for c in (client, other):
        assert c.get("/v1/batches/step-0001", headers=_auth(KEY_B)).status_code == 404
        assert c.get(f"/v1/jobs/{job}", headers=_auth(KEY_B)).status_code == 404
        assert c.get("/v1/batches/team-a:step-0001",
                     headers=_auth(KEY_B)).status_code == 404
    # A's payload bytes count to A, whose id the batch carries.
    store = farm.extensions["prorl"].store
    before = int(r.hget(keys.tenant("team-b"), "store_bytes") or 0)
    store.note_payload(sub.get_json()["batch_id"], 1_700_000)
    assert int(r.hget(keys.tenant("team-a"), "store_bytes")) == 1_700_000
    assert int(r.hget(keys.tenant("team-b"), "store_bytes") or 0) == before


def test_a_write_to_a_batch_record_moves_no_job_to_another_tenants_engine(farm, r):
    """Who a job belongs to is its own field and its batch's id: rewriting the batch
    record's ``tenant`` (one HSET, as anyone with the Redis once could) sends none of A's
    jobs to B's engine, counts none of its sandboxes to B, and shows A's batch to B not."""
    from prorl_farm.llm.registry import BackendSpec

    client = farm.test_client()
    sub = _submit(client, KEY_A, n=3).get_json()
    registry = BackendRegistry(r)
    b_engine = registry.register(BackendSpec("http://127.0.0.1:9", "vllm", "m", "/t",
                                             capacity=64, tenant="team-b"))
    r.hset(keys.batch(sub["batch_id"]), "tenant", "team-b")
    assert [registry.acquire(j) for j in sub["job_ids"]] == [None] * 3
    assert client.get(f"/v1/batches/{sub['batch_id']}",
                      headers=_auth(KEY_B)).status_code == 404
    assert registry.get(b_engine)["in_flight"] == 0


def test_warm_sandboxes_are_built_and_taken_per_tenant(farm, r):
    """A warm sandbox is one tenant's: the same instance waiting for A and for B is two INIT
    keys, so B's job never takes a sandbox built for A's (a warm hit would tell B that A
    runs the instance it does)."""
    from prorl_farm.worker.warm import WarmPool, init_key

    shell = {"commands": ["true"], "check": "true"}
    client = farm.test_client()
    for key, n in ((KEY_A, 3), (KEY_B, 2)):
        assert client.post("/v1/jobs", headers=_auth(key), json={
            "handler": "shell", "instances": [shell], "n": n}).status_code == 202
    svc = farm.extensions["prorl"]
    pool = WarmPool(svc.store, svc.settings, svc.registry, sandboxes=None)
    try:
        wanted = pool.demand()
    finally:
        pool._builders.shutdown()
    instance = svc.registry.get("shell").validate_instance(shell)
    assert {k: n for k, (_, _, n) in wanted.items()} == {
        init_key("team-a", "shell", instance): 3, init_key("team-b", "shell", instance): 2}


# -- engines ----------------------------------------------------------------------------


def _register(client, key, url, tokenizer, **extra):
    return client.post("/v1/backends", headers=_auth(key), json={
        "url": url, "kind": "vllm", "model": "m", "tokenizer": tokenizer, **extra})


def test_an_engine_is_one_tenants_under_every_spelling_of_its_url(farm, r, tokenizer):
    """A registers its engine; B's registration of it, written any way that reaches the
    same listener, is a 409 that names nobody, and sends the engine nothing; B's syncs and
    drains never reach it. Once A lets it go, B may have it."""
    engine = PolicyServer()
    client = farm.test_client()
    try:
        port = engine.url.rsplit(":", 1)[1]
        mine = _register(client, KEY_A, engine.url, tokenizer)
        assert mine.status_code == 201, mine.get_json()
        a_backend = mine.get_json()["id"]
        posts = list(engine.posts)
        # Spellings that reach it (409), and loopback ones that may not (nothing answers
        # there: 422); never B's.
        for url, status in ((engine.url, 409), (f"http://localhost:{port}", 409),
                            (f"http://LocalHost:{port}/", 409),
                            (f"http://127.0.0.1:{port}/v1", (409, 422)),
                            (f"http://0.0.0.0:{port}", (403, 409)),
                            (f"http://127.0.0.2:{port}/", (409, 422))):
            got = _register(client, KEY_B, url, tokenizer)
            assert got.status_code in (status if isinstance(status, tuple) else (status,)), \
                (url, got.get_json())
            text = got.get_data(as_text=True)
            assert "team-a" not in text and a_backend not in text and port not in text
        assert engine.posts == posts  # nothing sent while it was refused
        # The registry itself holds the claim (what `up --model` registers through, too).
        from prorl_farm.errors import Conflict
        from prorl_farm.llm.registry import BackendSpec

        with pytest.raises(Conflict):
            BackendRegistry(r).register(BackendSpec(f"http://localhost:{port}", "vllm", "m",
                                                    tokenizer, tenant="team-b"))
        # B's farm-wide weight sync reaches B's backends only (none here): 404, nothing sent.
        assert client.post("/v1/weights", headers=_auth(KEY_B), json={
            "path": "/nonexistent", "policy_version": 999}).status_code == 404
        assert engine.posts == posts
        assert r.hget(keys.backend(a_backend), "policy_version") == "0"
        # A lets it go: now it is B's to register.
        assert client.delete(f"/v1/backends/{a_backend}", headers=_auth(KEY_A)
                             ).status_code == 200
        got = _register(client, KEY_B, f"http://localhost:{port}", tokenizer)
        assert got.status_code == 201 and got.get_json()["tenant"] == "team-b"
        assert _register(client, KEY_A, engine.url, tokenizer).status_code == 409
    finally:
        engine.kill()


def test_registrations_side_by_side_give_an_engine_to_one_tenant(farm, r, tokenizer):
    """A and B register one engine at the same moment, 20 times: exactly one of them gets
    it each time."""
    engine = PolicyServer()
    registry = BackendRegistry(r)
    try:
        for _ in range(20):
            codes = dict(zip((KEY_A, KEY_B), _side_by_side(
                *(lambda k=k: _register(farm.test_client(), k, engine.url, tokenizer)
                  for k in (KEY_A, KEY_B)))))
            assert sorted(c.status_code for c in codes.values()) == [201, 409]
            for resp in codes.values():
                if resp.status_code == 201:
                    registry.unregister(resp.get_json()["id"])
        assert r.hlen(keys.ENGINES) == 0
    finally:
        engine.kill()


class _NotAnEngine(BaseHTTPRequestHandler):
    """Something on the host that answers HTTP, but is no inference server."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        send_body(self, 404 if self.path != "/health" else 200, b'{"ok": true}')


def test_registration_maps_nothing_of_the_host(farm, redis_server, tokenizer):
    """A tenant's registration of a URL where nothing listens, where an HTTP server that is
    no engine listens, of the farm's Redis and of the farm's API gets one and the same
    answer: the host's listeners are not the tenant's to map."""
    other = ModelHTTPServer(("127.0.0.1", 0), _NotAnEngine)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    settings = farm.extensions["prorl"].settings
    client = farm.test_client()
    try:
        urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{other.server_port}",
                f"http://127.0.0.1:{redis_server.url.rsplit(':', 1)[1].split('/')[0]}",
                f"http://localhost:{settings.api_port}", f"http://127.0.0.1:{settings.flower_port}"]
        answers = set()
        for url in urls:
            got = _register(client, KEY_B, url, tokenizer)
            answers.add((got.status_code, json.dumps(got.get_json())))
        assert len(answers) == 1, answers
        assert next(iter(answers))[0] == 422
        # A tokenizer path: one answer for a missing directory and one without a tokenizer.
        engine = PolicyServer()
        try:
            said = {json.dumps(_register(client, KEY_B, engine.url, p).get_json())
                    for p in ("/nonexistent", "/etc", "/proc/self")}
        finally:
            engine.kill()
        assert len(said) == 1, said
    finally:
        other.shutdown()
        other.server_close()


def test_without_the_operators_leave_a_tenant_registers_nothing_on_the_farms_host(
        redis_server, r, tokenizer):
    """By default (PRORL_TENANT_LOOPBACK unset) a tenant's key registers no URL on the
    farm's own host: one 403 for a live engine, a dead port and the farm's Redis alike;
    the operator's key registers a loopback engine."""
    from api import create_app

    app = create_app(load_settings(farm_env(redis_server.url, api_token=OPERATOR,
                                            tenants=json.dumps(TENANTS))))
    engine = PolicyServer()
    try:
        client = app.test_client()
        redis_port = redis_server.url.rsplit(":", 1)[1].split("/")[0]
        said = {(got.status_code, json.dumps(got.get_json())) for got in (
            _register(client, KEY_B, url, tokenizer) for url in (
                engine.url, f"http://127.0.0.1:{free_port()}", f"http://localhost:{redis_port}"))}
        assert len(said) == 1 and next(iter(said))[0] == 403, said
        assert "PRORL_TENANT_LOOPBACK" in next(iter(said))[1]
        assert engine.posts == []
        assert _register(client, OPERATOR, engine.url, tokenizer).status_code == 201
    finally:
        engine.kill()
        app.extensions["prorl"].close()


def test_the_farm_refuses_its_own_ports_to_the_operator_too(farm, redis_server, tokenizer):
    client = farm.test_client()
    port = redis_server.url.rsplit(":", 1)[1].split("/")[0]
    got = _register(client, OPERATOR, f"http://localhost:{port}", tokenizer)
    assert got.status_code == 403 and "own ports" in got.get_json()["error"]["message"]


# -- oracles ----------------------------------------------------------------------------


def test_another_tenants_id_and_a_free_one_get_the_same_answer(farm):
    """B learns nothing of A's ids: its submit into A's id is its own batch (not a 409),
    its reads of A's id (bare or as the farm names it) are the 404 a free id gets, byte for
    byte but the id, and a submit over B's quota is refused before anything else."""
    client = farm.test_client()
    a = _submit(client, KEY_A, batch_id="next-step").get_json()
    for path in ("/v1/batches/{}", "/v1/batches/{}/results?wait=0", "/v1/batches/{}/stats"):
        theirs = client.get(path.format(a["batch_id"]), headers=_auth(KEY_B))
        free = client.get(path.format("team-a:never-made"), headers=_auth(KEY_B))
        assert theirs.status_code == free.status_code == 404
        assert dict(theirs.headers).keys() == dict(free.headers).keys()
        assert theirs.get_data(as_text=True).replace(a["batch_id"], "team-a:never-made") \
            == free.get_data(as_text=True)
    # Over B's quota (5 queued), with A's id or a free one: the same 429.
    codes = {_submit(client, KEY_B, n=6, batch_id=b).get_json()["error"]["message"]
             for b in ("next-step", "free-one")}
    assert len(codes) == 1
    assert "team-a" not in json.dumps(client.get("/v1/tenants", headers=_auth(KEY_B)).get_json())


def test_a_tenant_sees_no_figure_of_anothers_share(farm, r):
    client = farm.test_client()
    r.hset(keys.held("init"), mapping={"team-a|0|x": 8, "team-b|0|y": 2})
    r.sadd(keys.QUEUES, "init")
    doc = client.get("/v1/tenants", headers=_auth(KEY_B)).get_json()
    (init,) = [q for q in doc["fair_share"] if q["queue"] == "init"]
    assert "held" not in init and [t["tenant"] for t in init["tenants"]] == ["team-b"]
    assert set(init["tenants"][0]) == {"tenant", "weight", "held", "waiting"}
    full = client.get("/v1/tenants", headers=_auth(OPERATOR)).get_json()
    assert [q for q in full["fair_share"] if q["queue"] == "init"][0]["held"] == 10


# -- doors ------------------------------------------------------------------------------


def test_the_gym_server_asks_every_caller_for_its_key_and_runs_as_its_tenant(farm, r):
    """The Gym agent server holds no key: with none, a caller gets 401 and nothing runs;
    with B's, B's row runs as B (its space, its quota: 429 once B is full); agent sessions
    are each caller's own. It never submits with the operator's key."""
    import asyncio

    from tornado.httpclient import AsyncHTTPClient
    from tornado.httpserver import HTTPServer
    from tornado.simple_httpclient import HTTPTimeoutError
    from werkzeug.serving import make_server

    from prorl_farm.gym.server import make_app
    from prorl_farm.tenants import parse_tenants

    api = make_server("127.0.0.1", 0, farm, threaded=True)
    threading.Thread(target=api.serve_forever, daemon=True).start()
    row = json.dumps({"responses_create_params": {"input": "2+2?", "max_output_tokens": 8},
                      "expected_answer": "4", "prorl_grader": "math"})

    async def attempt() -> dict:
        port = free_port()
        server = HTTPServer(make_app(f"http://127.0.0.1:{api.server_port}",
                                     api_token=OPERATOR,
                                     tenants=parse_tenants(json.dumps(TENANTS))))
        server.listen(port, "127.0.0.1")
        http = AsyncHTTPClient()

        async def call(path, key, body, timeout=30.0):
            try:
                resp = await http.fetch(f"http://127.0.0.1:{port}{path}", method="POST",
                                        body=body, headers=_auth(key), raise_error=False,
                                        request_timeout=timeout)
            except HTTPTimeoutError:
                return 599, b""
            return resp.code, resp.body

        out = {}
        try:
            out["none"] = [(await call(p, None, row))[0] for p in
                           ("/run", "/aggregate_metrics", "/v1/agent_sessions")]
            out["bad"] = (await call("/run", "not-a-key-0123456789", row))[0]
            # B's row: submitted as B (the client gives up; the row is then cancelled).
            out["b"] = (await call("/run", KEY_B, row, timeout=1.0))[0]
            while int(r.hget(keys.tenant("team-b"), "queued") or 0):  # cancelled as the
                await asyncio.sleep(0.05)  # client left
            for _ in range(5):  # B fills its quota of 5 queued
                assert _submit(farm.test_client(), KEY_B).status_code == 202
            out["b_full"] = await call("/run", KEY_B, row)
            sid = json.dumps({"agent_session_id": "s-1"})
            out["sessions"] = [(await call("/v1/agent_sessions/close", KEY_A, sid))[0],
                               (await call("/v1/agent_sessions", KEY_B, sid))[0]]
        finally:
            server.stop()
        return out

    try:
        out = asyncio.run(attempt())
    finally:
        api.shutdown()
        api.server_close()
    assert out["none"] == [401, 401, 401] and out["bad"] == 401
    assert out["b"] == 599  # the client's own timeout: the row was running
    code, body = out["b_full"]
    assert code == 429 and b"team-b" in body, body
    assert out["sessions"] == [200, 200]  # A's closed s-1 is not B's s-1
    batches = farm.test_client().get("/v1/batches", headers=_auth(OPERATOR)).get_json()
    gym = [b for b in batches["batches"] if "gym-" in b["batch_id"]]
    assert [b["tenant"] for b in gym] == ["team-b"] and gym[0]["total"] == 1


def test_a_tenants_own_gym_server_runs_keyless_rows_as_that_tenant_only():
    """For a collector that sends no key, a tenant runs its own Gym server with its own key
    (``--key-file``): a row without a key is that tenant's, a row with another key is
    refused; never with the operator's key, never off loopback."""
    import asyncio

    from prorl_farm.errors import ConfigError
    from prorl_farm.gym.server import Callers, serve
    from prorl_farm.tenants import parse_tenants

    tenants = parse_tenants(json.dumps(TENANTS))
    own = Callers("http://127.0.0.1:9", OPERATOR, tenants, own_key=KEY_A)
    assert own.who(None) == "tenant:team-a"
    assert own.who(f"Bearer {KEY_A}") == "tenant:team-a"
    assert own.who(f"Bearer {KEY_B}") is None and own.who(f"Bearer {OPERATOR}") is None
    assert own.farm("tenant:team-a", None).headers["Authorization"] == f"Bearer {KEY_A}"
    with pytest.raises(ConfigError, match="operator"):
        Callers("http://127.0.0.1:9", OPERATOR, tenants, own_key=OPERATOR)
    with pytest.raises(ConfigError, match="loopback"):
        asyncio.run(serve("0.0.0.0", free_port(), "http://127.0.0.1:9", OPERATOR,
                          tenants=tenants, own_key=KEY_A))
    shared = Callers("http://127.0.0.1:9", OPERATOR, tenants)
    assert shared.who(None) is None and shared.who(f"Bearer {KEY_B}") == "tenant:team-b"


# -- threads ----------------------------------------------------------------------------


@contextlib.contextmanager
def _deployed_api(redis_server, tmp_path):
    """The API as `up` runs it (gunicorn, its processes and threads) with the two tenants;
    yields (base URL, port)."""
    import os
    import subprocess
    import sys

    import requests

    from tests.farm import ROOT, stop_process, wait_until

    port = free_port()
    env = {**os.environ, **farm_env(redis_server.url, api_token=OPERATOR,
                                    tenants=json.dumps(TENANTS)),
           "PRORL_API_PORT": str(port), "PRORL_MAX_WAIT_S": "120"}
    log = open(tmp_path / "api.log", "wb")  # noqa: SIM115
    api = subprocess.Popen([sys.executable, "-m", "prorl_farm.cli", "api"], env=env, cwd=ROOT,
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:  # (gunicorn listens before its workers have booted: a slow answer)
                return requests.get(base + "/healthz", timeout=2).ok
            except requests.RequestException:
                return False

        wait_until(up, 60, 0.1, "the API")
        yield base, port
    finally:
        stop_process(api)
        log.close()


def test_one_tenants_long_polls_and_half_sent_requests_hold_no_thread_another_needs(
        redis_server, tmp_path):
    """The API as `up` runs it (gunicorn, its processes and threads): B holds 200
    long-polls on its own batch and 200 connections that sent half their headers (or half a
    body); A's submits and reads are all served while every one of B's is still open, and
    B's long-polls past its bound were answered 429 at once."""
    import socket

    import requests

    from tests.farm import wait_until

    held: list[socket.socket] = []
    with _deployed_api(redis_server, tmp_path) as (base, port):
        try:
            b_batch = requests.post(base + "/v1/jobs", headers=_auth(KEY_B), json={
                "handler": "synthetic", "instances": [{"run_s": 0}]}, timeout=30).json()["batch_id"]
            polls = []
            for i in range(400):
                s = socket.create_connection(("127.0.0.1", port))
                if i % 2 == 0:  # a long-poll on its own batch, whole
                    s.sendall(f"GET /v1/batches/{b_batch}/results?wait=100 HTTP/1.1\r\n"
                              f"Host: x\r\nAuthorization: Bearer {KEY_B}\r\n\r\n".encode())
                    polls.append(s)
                elif i % 4 == 1:  # half its headers
                    s.sendall(f"GET /v1/batches HTTP/1.1\r\nAuthorization: Bearer {KEY_B}\r\n"
                              .encode())
                else:  # its headers, and half of its body
                    s.sendall(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                              f"{KEY_B}\r\nContent-Type: application/json\r\nContent-Length: "
                              f"1000\r\n\r\n{{\"handler\":".encode())
                held.append(s)
            a = requests.Session()
            for _ in range(30):
                sub = a.post(base + "/v1/jobs", headers=_auth(KEY_A), timeout=30, json={
                    "handler": "synthetic", "instances": [{"run_s": 0}]})
                assert sub.status_code == 202, sub.text
                assert a.get(f"{base}/v1/batches/{sub.json()['batch_id']}", headers=_auth(KEY_A),
                             timeout=30).status_code == 200
                assert a.get(base + "/healthz", timeout=30).status_code == 200
            # Every connection of B's is still open (nothing was closed to make room), and
            # its long-polls past its bound (a quarter of each process's 16 threads: 4 in each
            # of the 2) were told 429; those within it still wait.
            answers: dict[socket.socket, bytes] = {}

            def told() -> int:
                for s in polls:
                    if s not in answers:
                        s.setblocking(False)
                        try:
                            answers[s] = s.recv(4096)
                        except BlockingIOError:
                            pass
                return len(answers)

            wait_until(lambda: told() >= len(polls) - 8, 60, 0.1, "B's long-polls past its bound")
            assert all(head.startswith(b"HTTP/1.1 429") for head in answers.values()), \
                {head[:100] for head in answers.values()}
            assert 4 <= len(polls) - len(answers) <= 8, len(answers)
        finally:
            for s in held:
                s.close()


def test_a_client_past_its_keys_bound_is_served_in_turn(redis_server, tmp_path):
    """FarmClient takes the API's 429 for a key past its share of the threads as the
    request not taken, and asks again: 16 long-polls of B at once (its bound: 8) are all
    answered."""
    from concurrent.futures import ThreadPoolExecutor

    from prorl_farm.trainer import FarmClient

    with _deployed_api(redis_server, tmp_path) as (base, _):
        farm = FarmClient(base, token=KEY_B, backoff_s=0.2)
        batch = farm.submit("synthetic", [{"run_s": 0}])["batch_id"]
        with ThreadPoolExecutor(16) as ex:
            pages = list(ex.map(lambda _: FarmClient(base, token=KEY_B, backoff_s=0.2)
                                .results(batch, wait_s=1.0), range(16)))
    assert len(pages) == 16
