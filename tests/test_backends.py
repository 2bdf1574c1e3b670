"""LLM backends: the min-heap under concurrency, sticky routing, fail-over, drain/resume,
health probes — against real Redis, real worker pools and scripted policy servers."""

from __future__ import annotations

import random
import threading
import time

import pytest

from api import create_app
from prorl_farm.config import load_settings
from prorl_farm.llm.registry import BackendRegistry, BackendSpec
from tests.conftest import make_pools
from tests.farm import farm_env, free_port, wait_until
from tests.policy_server import PolicyServer, per_job_servers

EPS = 1e-9


def spec(url: str, capacity: int = 1, kind: str = "vllm", version: str = "0") -> BackendSpec:
    return BackendSpec(url=url, kind=kind, model="m", tokenizer="/nonexistent", capacity=capacity,
                       policy_version=version)


def check_audit(records: list[dict]) -> None:
    """At every acquire the chosen backend had the heap's least key (the shortest expected
    delay) among those the job could take."""
    assert records, "no acquire was audited"
    for rec in records:
        scores = {b: s for b, s in rec["scores"].items() if b != rec["exclude"]}
        assert scores[rec["chosen"]] <= min(scores.values()) + EPS, rec


@pytest.fixture
def registry(r):
    return BackendRegistry(r, audit=True)


def test_heap_under_concurrent_acquire_and_release(registry, r):
    ids = [registry.register(spec(f"http://127.0.0.1:{9000 + i}", cap))
           for i, cap in enumerate((1, 2, 1))]
    negative = []

    def worker(w: int) -> None:
        rnd = random.Random(w)
        for j in range(10):
            job = f"job-{w}-{j}"
            assert registry.acquire(job) in ids
            assert registry.acquire(job) == registry.acquire(job)  # sticky
            time.sleep(rnd.random() * 0.005)
            if any(v < 0 for v in registry.in_flight().values()):
                negative.append(job)
            registry.release(job)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not negative
    assert registry.in_flight() == {i: 0 for i in ids}
    assert r.hlen("prorl:backends:assign") == 0
    check_audit(registry.audit_log())
    # Capacity-weighted: the capacity-2 backend took about half of all jobs.
    totals = {b["id"]: b["jobs_total"] for b in registry.list()}
    assert totals[ids[1]] > totals[ids[0]] and totals[ids[1]] > totals[ids[2]]


def test_a_slower_backend_takes_fewer_jobs_by_its_expected_delay(registry, r):
    """Least added request time: with service times 10 ms and 30 ms (learnt from
    latencies) and capacity 2 each, a job goes where it costs least, its own turns plus the
    queueing it adds to the others': six jobs to the fast backend, two to the slow one."""
    fast, slow = (registry.register(spec(f"http://127.0.0.1:{9200 + i}", 2)) for i in range(2))
    registry.record_latency(fast, 10.0)
    registry.record_latency(slow, 30.0)
    for i in range(8):
        registry.acquire(f"j{i}")
    assert registry.in_flight() == {fast: 6, slow: 2}
    check_audit(registry.audit_log())
    info = registry.get(fast)
    assert info["service_ms"] == 10.0 and info["load"] == 3.0
    # One more there: a turn of 10 * 7/2 ms, and 10/2 ms more for each of the six others.
    assert info["expected_delay_ms"] == pytest.approx(35.0 + 6 * 5.0, rel=1e-5)
    # A latency measured under load counts only the part the load does not explain: 60 ms
    # with 6 jobs on 2 slots is a 20 ms service time (folded into the average at 0.2).
    registry.record_latency(fast, 60.0)
    assert registry.get(fast)["service_ms"] == pytest.approx(0.8 * 10 + 0.2 * 20, abs=1e-3)
    for i in range(8):
        registry.release(f"j{i}")
    # A new backend is expected to serve at the farm-wide average (10, 30, 20 ms: 15.2 ms):
    # dearer than the fast one with a free slot (12 ms), cheaper once that one is full.
    c = registry.register(spec("http://127.0.0.1:9210", 2))
    assert registry.get(c)["expected_delay_ms"] == pytest.approx(15.2, abs=1e-3)
    assert [registry.acquire(j) for j in "xyz"] == [fast, fast, c]


def test_drain_unhealthy_unregister_leave_the_heap(registry, r):
    a, b = (registry.register(spec(f"http://127.0.0.1:{9100 + i}")) for i in range(2))
    registry.drain(a)
    assert {registry.acquire(f"j{i}") for i in range(5)} == {b}
    registry.resume(a, 7)
    assert registry.get(a)["policy_version"] == 7 and registry.get(a)["in_heap"]
    registry.mark_unhealthy(b, "boom")
    assert registry.acquire("k") == a and not registry.get(b)["in_heap"]
    registry.unregister(a)
    assert registry.acquire("k2") is None  # b unhealthy, a gone
    # Jobs pinned to an unregistered backend release cleanly (no negative or stale count).
    registry.release("k")
    registry.mark_healthy(b)
    assert registry.acquire("j0") == b  # was pinned to b all along (sticky)
    for i in range(5):
        registry.release(f"j{i}")
    assert registry.in_flight() == {b: 0}


def test_terminal_transitions_release_the_slot(settings, r):
    from prorl_farm.jobs.store import JobStore
    from prorl_farm.states import JobState

    store = JobStore.from_settings(settings)
    registry = BackendRegistry(r)
    bid = registry.register(spec("http://127.0.0.1:9200", capacity=4))
    jobs = store.create_jobs("b", "synthetic", [{}], 3, {}, None)
    for j in jobs:
        store.claim(j.job_id, "init", j.token, "w")
        registry.acquire(j.job_id)
    assert registry.in_flight()[bid] == 3
    store.finish(jobs[0].job_id, JobState.CANCELLED, "cancelled", "x")
    store.advance(jobs[1].job_id, "init", jobs[1].token, "run", "run.n", "n", "hstate", "{}")
    store.reap(jobs[2].job_id, "active", store.server_time() + 1, jobs[2].token, "", "dead")
    assert registry.in_flight()[bid] == 0
    assert registry.get(bid)["load"] == 0.0
    # A stage that has not noticed its job ended yet cannot pin it again (a slot would be
    # held for a job that is over: found by the RL loop, whose sampler cancels surplus
    # groups mid-turn).
    assert registry.acquire(jobs[0].job_id) is None
    assert registry.pin(jobs[0].job_id) is None
    assert registry.in_flight()[bid] == 0
    assert registry.acquire(jobs[1].job_id) == bid  # not terminal: pins as before


def test_backend_api(client, r, tokenizer, tmp_path):
    bad = [({"url": "ftp://x", "kind": "vllm", "model": "m", "tokenizer": "t"}, "url"),
           ({"url": "http://x:1", "kind": "tgi", "model": "m", "tokenizer": "t"}, "kind"),
           ({"url": "http://x:1", "kind": "vllm", "model": "m"}, "tokenizer"),
           ({"url": "http://x:1", "kind": "vllm", "model": "m", "tokenizer": "t",
             "capacity": 0}, "capacity")]
    for body, field in bad:
        resp = client.post("/v1/backends", json=body)
        assert resp.status_code == 400 and field in resp.get_json()["error"]["message"]
    assert r.scard("prorl:backends:all") == 0
    # Probed at registration: an unreachable backend is registered unhealthy, out of the heap,
    # with the reason; ?probe=strict refuses it and stores nothing.
    # A tokenizer that does not load is refused, the path named, and nothing is stored.
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    for path, why in (("/t", "no such directory"), (str(tmp_path), "none of"),
                      (str(tmp_path / "broken"), "does not load")):
        resp = client.post("/v1/backends", json={"url": "http://127.0.0.1:9", "kind": "vllm",
                                                 "model": "m", "tokenizer": path})
        error = resp.get_json()["error"]
        assert resp.status_code == 400 and error["code"] == "invalid_tokenizer", error
        assert path in error["details"]["tokenizer"][0] and why in error["message"]
    assert r.scard("prorl:backends:all") == 0
    dead = {"url": f"http://127.0.0.1:{free_port()}", "kind": "vllm", "model": "m",
            "tokenizer": tokenizer}
    strict = client.post("/v1/backends?probe=strict", json=dead)
    assert strict.status_code == 422 and "unreachable" in strict.get_json()["error"]["message"]
    assert r.scard("prorl:backends:all") == 0
    lenient = client.post("/v1/backends", json=dead)
    assert lenient.status_code == 201
    d = lenient.get_json()
    assert not d["healthy"] and not d["in_heap"] and "unreachable" in d["last_error"]
    assert client.delete(f"/v1/backends/{d['id']}").status_code == 200
    server = PolicyServer()
    try:
        made = client.post("/v1/backends?probe=strict", json={
            "url": server.url, "kind": "sglang", "model": "m", "tokenizer": tokenizer,
            "capacity": 3})
    finally:
        server.kill()
    assert made.status_code == 201
    b = made.get_json()
    assert b["healthy"] and b["last_error"] is None
    assert b["logprobs_mode"] == "processed_logprobs" and b["in_heap"] and b["in_flight"] == 0
    assert [x["id"] for x in client.get("/v1/backends").get_json()["backends"]] == [b["id"]]
    drained = client.post(f"/v1/backends/{b['id']}/drain").get_json()
    assert drained["drained"] and not drained["in_heap"]
    assert client.post(f"/v1/backends/{b['id']}/resume", json={}).status_code == 400
    resumed = client.post(f"/v1/backends/{b['id']}/resume", json={"policy_version": 3})
    assert resumed.get_json()["policy_version"] == 3 and resumed.get_json()["in_heap"]
    # Versions only grow: a lower one is refused and changes nothing; the same one is fine.
    client.post(f"/v1/backends/{b['id']}/drain")
    back = client.post(f"/v1/backends/{b['id']}/resume", json={"policy_version": 2})
    assert back.status_code == 409
    assert back.get_json()["error"]["code"] == "policy_version_regressed"
    still = client.get(f"/v1/backends/{b['id']}").get_json()
    assert still["policy_version"] == 3 and still["drained"]
    assert client.post(f"/v1/backends/{b['id']}/resume", json={"policy_version": "4"}
                       ).status_code == 400  # a number, not a string
    assert client.post(f"/v1/backends/{b['id']}/resume", json={"policy_version": 3}
                       ).status_code == 200
    assert client.delete(f"/v1/backends/{b['id']}").status_code == 200
    assert client.get(f"/v1/backends/{b['id']}").status_code == 404
    assert client.post("/v1/backends/nope/drain").status_code == 404


# -- through real worker pools ------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_pools(redis_server, tmp_path_factory):
    overrides = dict(run_concurrency=300, backend_audit=1, llm_retries=0,
                     llm_request_timeout_s=5)
    pools = make_pools(redis_server, tmp_path_factory.mktemp("llm"), **overrides)
    pools.start()
    client = create_app(load_settings(farm_env(redis_server.url, **overrides))).test_client()
    yield pools, client
    pools.stop()


class Servers(dict):
    """name -> PolicyServer, and the tokenizer their registrations name."""

    tokenizer = ""


@pytest.fixture
def servers(tokenizer):
    made = Servers()
    made.tokenizer = tokenizer
    yield made
    for s in made.values():
        try:
            s.kill()
        except OSError:
            pass


def submit(client, instances, n=1):
    resp = client.post("/v1/jobs", json={"handler": "synthetic", "instances": instances, "n": n})
    assert resp.status_code == 202, resp.get_json()
    return resp.get_json()


def finish(client, sub, timeout_s=120):
    summary = f"/v1/batches/{sub['batch_id']}"
    wait_until(lambda: client.get(summary).get_json()["complete"], timeout_s, 0.2,
               lambda: f"batch {client.get(summary).get_json()}")
    return [client.get(f"/v1/jobs/{i}").get_json() for i in sub["job_ids"]]


def register(client, servers, name, capacity=1, kind="vllm", delay_s=0.0):
    servers[name] = PolicyServer(delay_s=delay_s)
    resp = client.post("/v1/backends", json={"url": servers[name].url, "kind": kind,
                                             "model": "m", "tokenizer": servers.tokenizer,
                                             "capacity": capacity})
    return resp.get_json()["id"]


def test_300_concurrent_jobs_on_3_backends(llm_pools, servers, r):
    pools, client = llm_pools
    ids = {register(client, servers, "a", 1): "a", register(client, servers, "b", 2, "sglang"): "b",
           register(client, servers, "c", 1): "c"}
    # Long enough runs that dozens overlap however busy the machine is (the suite's other
    # workers share its cores).
    sub = submit(client, [{"run_s": 2.0, "llm_turns": 3}], n=300)
    jobs = finish(client, sub)
    assert [j["failure"] for j in jobs if j["failure"]] == []
    audit = BackendRegistry(r).audit_log()
    check_audit(audit)
    assert len(audit) == 300
    assert min(score for a in audit for score in a["scores"].values()) >= 0
    assert BackendRegistry(r).in_flight() == {b: 0 for b in ids}
    # Sticky: every turn of a job went to one backend, as the servers saw it.
    seen = per_job_servers(servers)
    assert set(seen) == set(sub["job_ids"])
    multi = {j["id"]: (seen[j["id"]], j["result"]) for j in jobs if len(seen[j["id"]]) != 1}
    assert not multi
    for j in jobs:
        assert {ids[b] for b in j["result"]["backends"]} == seen[j["id"]]
    # They really ran at once: some acquire saw dozens of jobs pinned to one backend.
    assert max(a["in_flight"] for a in audit) >= 30


def test_dead_backend_mid_batch_fails_over_or_fails_cleanly(llm_pools, servers, r):
    pools, client = llm_pools
    for name in "abc":
        register(client, servers, name, 1, delay_s=0.05)
    sub = submit(client, [{"run_s": 1.0, "llm_turns": 6}], n=60)
    wait_until(lambda: sum(len(s.requests) for s in servers.values()) > 100, 30, what="progress")
    servers["b"].kill()
    jobs = finish(client, sub)
    states = {(j["state"], (j["failure"] or {}).get("kind")) for j in jobs}
    assert states <= {("done", None), ("failed", "backend_unavailable")}
    moved = [j for j in jobs if j["state"] == "done" and j["result"]["failovers"]]
    assert moved, "jobs pinned to the dead backend should have failed over"
    backends = {b["url"]: b for b in BackendRegistry(r).list()}
    dead = backends[servers["b"].url]
    assert not dead["healthy"] and not dead["in_heap"] and dead["last_error"]
    assert BackendRegistry(r).in_flight() == {b["id"]: 0 for b in backends.values()}


def test_unregister_mid_batch(llm_pools, servers, r):
    pools, client = llm_pools
    a = register(client, servers, "a", 1, delay_s=0.05)
    register(client, servers, "b", 1, delay_s=0.05)
    sub = submit(client, [{"run_s": 1.0, "llm_turns": 5}], n=30)
    wait_until(lambda: len(servers["a"].requests) > 20, 30, what="progress on a")
    assert client.delete(f"/v1/backends/{a}").status_code == 200
    jobs = finish(client, sub)
    assert [j["state"] for j in jobs] == ["done"] * 30
    assert r.hget("prorl:backends:inflight", a) is None
    assert BackendRegistry(r).in_flight() == {b["id"]: 0 for b in BackendRegistry(r).list()}


def test_drain_and_resume_with_policy_version(llm_pools, servers, r):
    pools, client = llm_pools
    a = register(client, servers, "a")
    b = register(client, servers, "b")
    client.post(f"/v1/backends/{a}/drain")
    jobs = finish(client, submit(client, [{"llm_turns": 2}], n=20))
    assert servers["a"].requests == []
    assert all(j["result"]["backends"] == [b, b] for j in jobs)
    client.post(f"/v1/backends/{a}/resume", json={"policy_version": 2})
    client.post(f"/v1/backends/{b}/drain")
    jobs = finish(client, submit(client, [{"llm_turns": 2}], n=10))
    assert all(j["result"]["policy_versions"] == [2, 2] for j in jobs)
    assert all(j["policy_version"] == 2 for j in jobs)
    assert len(servers["a"].requests) == 20


def test_failed_backend_returns_after_a_probe(llm_pools, servers, r):
    pools, client = llm_pools
    a = register(client, servers, "a")
    servers["a"].fail = True
    jobs = finish(client, submit(client, [{"llm_turns": 1}]))
    assert jobs[0]["failure"]["kind"] == "backend_unavailable"
    assert not client.get(f"/v1/backends/{a}").get_json()["in_heap"]
    servers["a"].fail = False
    wait_until(lambda: client.get(f"/v1/backends/{a}").get_json()["in_heap"], 20, 0.2,
               "probe to bring the backend back")
    assert finish(client, submit(client, [{"llm_turns": 1}]))[0]["state"] == "done"


def test_cancel_aborts_the_in_flight_request(llm_pools, servers, r):
    pools, client = llm_pools
    a = register(client, servers, "slow", delay_s=30)
    sub = submit(client, [{"llm_turns": 1}])
    job_id = sub["job_ids"][0]
    wait_until(lambda: servers["slow"].in_flight == 1, 20, what="request in flight")
    client.post(f"/v1/jobs/{job_id}/cancel")
    assert client.get(f"/v1/jobs/{job_id}").get_json()["state"] == "cancelled"
    assert BackendRegistry(r).in_flight()[a] == 0
    # The stage stopped at once (the request's socket was shut), not after the 30 s reply.
    wait_until(lambda: r.zscore("prorl:active", job_id) is None, 5, what="slot freed")


def test_requests_reuse_one_connection_and_survive_its_close():
    """A client keeps its connection alive across requests, and the next job's client takes
    it over once closed; when the server has closed an idle one, the next request goes out
    once more on a new connection, not as a failure."""
    from prorl_farm.llm.backends import client_for
    from prorl_farm.llm.backends.abstract import _IDLE

    server = PolicyServer()
    try:
        client = client_for("vllm", server.url, "m", timeout_s=5, retries=0)
        for _ in range(5):
            assert len(client.generate([1, 2, 3], {"max_tokens": 4}).token_ids) == 4
        assert server.accepted == 1 and len(server.requests) == 5
        server.drop_connections()
        wait_until(lambda: not server.connections, 5, what="connections closed")
        assert len(client.generate([1, 2], {"max_tokens": 2}).token_ids) == 2
        assert server.accepted == 2 and len(server.requests) == 6
        client.close()
        # The next client (the next job's) reuses the idle connection.
        clients = [client_for("vllm", server.url, "m", timeout_s=5, retries=0)
                   for _ in range(3)]
        for c in clients:
            assert len(c.generate([1], {"max_tokens": 1}).token_ids) == 1
        assert server.accepted == 4  # the first reused it, the others opened their own
        for c in clients:
            c.close()
        # Three idle connections, all dropped by the server: each next client's request
        # still succeeds (on a new connection), though retries are off.
        server.drop_connections()
        wait_until(lambda: not server.connections, 5, what="connections closed")
        for _ in range(3):
            client = client_for("vllm", server.url, "m", timeout_s=5, retries=0)
            assert len(client.generate([1], {"max_tokens": 1}).token_ids) == 1
            client.close()
        # The first found a dropped one and went out on a new connection, which the next
        # two reused.
        assert server.accepted == 5 and len(server.requests) == 12
        server.kill()
        with pytest.raises(Exception, match="ConnectionRefused"):
            client.generate([1], {"max_tokens": 1})
    finally:
        server.kill()
        _IDLE.close_all()


def test_latency_is_recorded_for_every_request(settings, r):
    """Turns within the pin's lifetime skip the pin's round trip; their latencies are still
    folded into the backend's average, at the next pin or when the session closes."""
    from prorl_farm.context import JobContext
    from prorl_farm.llm.session import BackendSession

    server = PolicyServer()
    try:
        registry = BackendRegistry(r)
        b = registry.register(BackendSpec(url=server.url, kind="vllm", model="m",
                                          tokenizer="t", capacity=4))
        ctx = JobContext(job_id="j", batch_id="b", stage="run", token="t", node="n",
                         instance={}, sampling={}, backends=registry, sandboxes=None,
                         settings=settings)
        with BackendSession(registry, ctx) as session:
            for _ in range(7):
                session.generate([1, 2, 3], {"max_tokens": 2})
        info = registry.get(b)
        assert int(info["requests_total"]) == 7 and float(info["latency_ms"]) > 0
        assert registry.in_flight() == {b: 1}  # the job stays pinned until it ends
    finally:
        server.kill()


def _tokenizer_copy(tiny_model, dest):
    """A directory holding only the tiny model's tokenizer (a backend's own)."""
    import shutil

    dest.mkdir()
    for f in tiny_model.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "vocab",
                              "merges")):
            shutil.copy(f, dest / f.name)
    return str(dest)


@pytest.mark.slow
def test_a_farm_restarted_over_dead_registrations_serves_on_its_healthy_backend(
        tmp_path, dev_server, tiny_model):
    """Issue: a farm whose Redis kept the backends of an earlier run (their servers gone,
    their tokenizer directories deleted) failed every job of a new run ``run_error`` though
    the run had registered a healthy backend. Now the RUN pool checks the registrations as
    it starts, a backend whose tokenizer does not load when a job meets it leaves the heap
    and the job moves on (no fail-over spent), and the batch has no failure."""
    import shutil

    import redis

    from tests.farm import Pools, RedisServer

    server = RedisServer(tmp_path / "redis", appendonly=True)
    pools = None
    try:
        # The earlier run's registrations, left in the registry as they were (healthy).
        registry = BackendRegistry(redis.Redis.from_url(server.url, decode_responses=True))
        stale = []
        for i, (url, gone_tokenizer) in enumerate([
                (f"http://127.0.0.1:{free_port()}", False),   # its server gone
                (f"http://127.0.0.1:{free_port()}", True),    # both gone
                (str(dev_server), True)]):                     # its tokenizer deleted
            path = _tokenizer_copy(tiny_model, tmp_path / f"old-{i}")
            if gone_tokenizer:
                shutil.rmtree(path)
            stale.append(registry.register(BackendSpec(url, "vllm", "tiny", path, 64)))
        env = farm_env(server.url, run_concurrency=8)
        (tmp_path / "pools").mkdir()
        pools = Pools(env, tmp_path / "pools")
        pools.start()
        client = create_app(load_settings(env)).test_client()
        # This run's backends: one healthy, one whose tokenizer is deleted after it was
        # registered (no probe has seen it yet when the jobs meet it).
        ids = {}
        for name in ("good", "doomed"):
            resp = client.post("/v1/backends", json={
                "url": dev_server, "kind": "vllm", "model": "tiny", "capacity": 64,
                "tokenizer": _tokenizer_copy(tiny_model, tmp_path / name)})
            assert resp.status_code == 201, resp.get_json()
            ids[name] = resp.get_json()["id"]
        shutil.rmtree(tmp_path / "doomed")
        instances = [{"messages": [{"role": "user", "content": f"hello {i}"}],
                      "observations": ["more"], "answer": "x"} for i in range(4)]
        resp = client.post("/v1/jobs", json={"handler": "chat", "instances": instances,
                                             "n": 4, "sampling": {"max_tokens": 8}})
        assert resp.status_code == 202, resp.get_json()
        jobs = finish(client, resp.get_json())
        assert [j["failure"] for j in jobs if j["failure"]] == []
        assert {t["backend"] for j in jobs for t in j["result"]["turns"]} == {ids["good"]}
        listed = {b["id"]: b for b in client.get("/v1/backends").get_json()["backends"]}
        for backend_id in [*stale, ids["doomed"]]:
            b = listed[backend_id]
            assert not b["healthy"] and not b["in_heap"] and b["last_error"], b
        assert "tokenizer" in listed[ids["doomed"]]["last_error"]
        assert BackendRegistry(registry.r).in_flight() == {b: 0 for b in listed}
    finally:
        if pools is not None:
            pools.stop()
        server.stop()
