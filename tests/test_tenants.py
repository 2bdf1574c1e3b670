"""Tenants (prorl_farm/tenants.py): a batch belongs to the tenant whose key submitted it, or
to the one it names where the key may; a tenant's usage (jobs queued and in flight, store
bytes) follows its jobs' states as the farm's own scripts move them; a submit over a quota
is a 429 with Retry-After and a field-level message, and enqueues nothing; FarmClient waits
and submits again once there is room. Against a real Redis, through the API's routes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from werkzeug.serving import make_server

from prorl_farm import keys
from prorl_farm.config import load_settings
from prorl_farm.errors import ConfigError
from prorl_farm.tenants import parse_tenants, usage
from prorl_farm.trainer import FarmClient
from tests.farm import farm_env, scrape, wait_until

OPERATOR = "operator-key-0123456789"
KEY_A, KEY_B = "team-a-key-0123456789", "team-b-key-0123456789"
TENANTS = {"team-a": {"token": KEY_A, "weight": 2, "may_use": ["team-a-eval"],
                      "max_queued": 10},
           "team-a-eval": {"weight": 1},
           "team-b": {"token": KEY_B, "max_in_flight": 4, "max_sandboxes": 2}}


@pytest.fixture
def farm(redis_server, r):
    from api import create_app

    settings = load_settings(farm_env(redis_server.url, api_token=OPERATOR,
                                      tenants=json.dumps(TENANTS)))
    app = create_app(settings)
    yield app, app.test_client()
    app.extensions["prorl"].close()


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _submit(client, key, n=1, **body):
    body = {"handler": "synthetic", "instances": [{"run_s": 0.0}], "n": n, **body}
    return client.post("/v1/jobs", json=body, headers=_auth(key))


def _usage(client) -> dict:
    doc = client.get("/v1/tenants", headers=_auth(OPERATOR)).get_json()
    return {t["tenant"]: t["usage"] for t in doc["tenants"]}


@pytest.mark.parametrize("raw, says", [
    ('{"a": {"tokn": "x"}}', "a takes"),
    ('{"a b": {}}', "tenant name"),
    ('{"a": {"token": "short"}}', "a.token"),
    ('{"a": {"weight": 0}}', "a.weight"),
    ('{"a": {"max_queued": -1}}', "a.max_queued"),
    ('{"a": {"max_queued": 1.5}}', "a.max_queued"),
    ('{"a": {"may_use": ["nobody"]}}', "unknown tenants"),
    ('{"a": {"token": "0123456789abcdef"}, "b": {"token": "0123456789abcdef"}}', "b.token"),
    ("[1]", "an object"),
    ("{", "not JSON"),
])
def test_a_bad_tenants_setting_stops_start_up_naming_the_entry(raw, says):
    with pytest.raises(ConfigError, match=says):
        parse_tenants(raw)
    with pytest.raises(ConfigError, match="PRORL_TENANTS"):
        load_settings({"PRORL_TENANTS": raw})


def test_a_batch_belongs_to_its_keys_tenant_or_one_it_may_use(farm):
    _, client = farm
    a = _submit(client, KEY_A, n=3)
    assert a.status_code == 202, a.get_json()
    batch = client.get(f"/v1/batches/{a.get_json()['batch_id']}",
                       headers=_auth(KEY_A)).get_json()
    assert batch["tenant"] == "team-a"
    assert _submit(client, KEY_A, tenant="team-a-eval").status_code == 202
    assert _submit(client, OPERATOR, tenant="team-b").status_code == 202
    assert _submit(client, OPERATOR).status_code == 202  # the operator's own: default
    now = _usage(client)
    assert (now["team-a"]["queued"], now["team-a-eval"]["queued"],
            now["team-b"]["queued"], now["default"]["queued"]) == (3, 1, 1, 1)
    # The same on /metrics, with the quotas.
    m = scrape(client, OPERATOR)
    assert m[("prorl_tenant_jobs", (("state", "queued"), ("tenant", "team-a")))] == 3
    assert m[("prorl_tenant_quota", (("quota", "max_queued"), ("tenant", "team-a")))] == 10
    assert ("prorl_tenant_quota", (("quota", "max_queued"), ("tenant", "team-b"))) not in m


@pytest.mark.parametrize("key, tenant, status, code", [
    (KEY_B, "team-a-eval", 403, "forbidden"),  # not B's to use
    (KEY_A, "team-b", 403, "forbidden"),
    (KEY_A, "nobody", 403, "forbidden"),  # as for one that exists: no oracle
    (None, None, 401, "unauthorized"),
    ("not-a-key-0123456789", None, 401, "unauthorized"),
])
def test_a_submit_for_a_tenant_the_key_may_not_use_is_refused_and_enqueues_nothing(
        farm, r, key, tenant, status, code):
    _, client = farm
    before = r.hgetall(keys.STATE_COUNTS)
    resp = _submit(client, key, **({"tenant": tenant} if tenant else {}))
    assert resp.status_code == status, resp.get_json()
    err = resp.get_json()["error"]
    assert err["code"] == code
    if status != 401:
        assert "tenant" in err["details"], err
    assert r.hgetall(keys.STATE_COUNTS) == before and r.llen("init") == 0


def test_the_same_client_batch_id_is_two_batches_one_per_tenant(farm, r):
    """A batch id lives in its tenant's space: B's submit into A's id makes B's own batch,
    takes nothing of A's, and each reads its own by the bare id."""
    _, client = farm
    first = _submit(client, KEY_A, batch_id="shared-step-1")
    assert first.status_code == 202 and first.get_json()["batch_id"] == "team-a:shared-step-1"
    resp = _submit(client, KEY_B, batch_id="shared-step-1", n=2)
    assert resp.status_code == 202 and resp.get_json()["batch_id"] == "team-b:shared-step-1"
    for key, tenant, total in ((KEY_A, "team-a", 1), (KEY_B, "team-b", 2)):
        for name in ("shared-step-1", f"{tenant}:shared-step-1"):
            got = client.get(f"/v1/batches/{name}", headers=_auth(key)).get_json()
            assert (got["tenant"], got["total"]) == (tenant, total)
    assert client.get("/v1/batches/team-a:shared-step-1",
                      headers=_auth(KEY_B)).status_code == 404
    assert client.post("/v1/batches/shared-step-1/cancel",
                       headers=_auth(KEY_B)).get_json()["cancelled"] == 2
    assert client.get("/v1/batches/shared-step-1", headers=_auth(KEY_A)
                      ).get_json()["counts"]["queued"] == 1


def test_over_quota_is_a_429_that_enqueues_nothing_until_there_is_room(farm, r):
    """team-a may hold 10 jobs queued: 8 go in, 4 more are refused (429, Retry-After, the
    field named, nothing written), and go in once 4 of the 8 are cancelled (the cancel
    moves them out of the tenant's queued count, in the farm's own script)."""
    _, client = farm
    first = _submit(client, KEY_A, n=8).get_json()
    before = (r.hgetall(keys.STATE_COUNTS), r.llen("init"), r.zcard(keys.BATCHES))
    over = _submit(client, KEY_A, n=4)
    assert over.status_code == 429, over.get_json()
    assert int(over.headers["Retry-After"]) > 0
    err = over.get_json()["error"]
    assert err["code"] == "over_quota" and "quota of 10" in err["details"]["tenant"][0]
    assert (r.hgetall(keys.STATE_COUNTS), r.llen("init"), r.zcard(keys.BATCHES)) == before
    for job in first["job_ids"][:4]:
        assert client.post(f"/v1/jobs/{job}/cancel", headers=_auth(KEY_A)).status_code == 200
    now = _usage(client)["team-a"]
    assert (now["queued"], now["cancelled"]) == (4, 4)
    assert _submit(client, KEY_A, n=4).status_code == 202
    assert _usage(client)["team-a"]["queued"] == 8
    # The quota is the tenant's: another tenant's key still submits.
    assert _submit(client, KEY_B, n=20).status_code == 202


def test_in_flight_and_store_quotas_refuse_a_submit_while_over(farm, r):
    app, client = farm
    store = app.extensions["prorl"].store
    r.hset(keys.tenant("team-b"), "run", 4)  # four of team-b's jobs in RUN
    resp = _submit(client, KEY_B)
    assert resp.status_code == 429 and "in flight" in resp.get_json()["error"]["message"]
    r.hset(keys.tenant("team-b"), "run", 3)
    sub = _submit(client, KEY_B).get_json()
    # Store bytes follow the tenant's payloads in and out of the trajectory store.
    store.note_payload(sub["batch_id"], 3 * 2**20)
    assert usage(r, ["team-b"])["team-b"]["store_mb"] == 3.0
    store.payloads_gone(sub["batch_id"], 1, 3 * 2**20, acked=True)
    assert usage(r, ["team-b"])["team-b"]["store_mb"] == 0.0


def test_the_client_waits_out_a_quota_and_its_submit_gets_through(farm, capfd):
    """FarmClient's submit over quota: it says so, waits as Retry-After says, submits
    again, and gets through once jobs have left the tenant's queue."""
    app, client = farm
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        farm_a = FarmClient(f"http://127.0.0.1:{server.server_port}", token=KEY_A,
                            quota_wait_s=60)
        first = farm_a.submit("synthetic", [{"run_s": 0.0}], n=10)
        got: dict = {}
        waiter = threading.Thread(target=lambda: got.update(
            farm_a.submit("synthetic", [{"run_s": 0.0}], n=5)))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not got  # refused, waiting
        for job in first["job_ids"][:5]:
            farm_a.cancel(job)
        waiter.join(30)
        assert len(got["job_ids"]) == 5
        assert "over_quota" in capfd.readouterr().err
        assert farm_a.tenants()["you"] == "team-a"
    finally:
        server.shutdown()
        server.server_close()


def test_a_tenants_live_sandboxes_count_until_they_stop(farm, r, tmp_path):
    """Real sandboxes (the node's sandbox manager) started for team-b's job count as its
    live sandboxes; at its quota of 2 a submit is refused; each stop gives one back."""
    from prorl_farm.sandbox.abstract import SandboxSpec
    from prorl_farm.sandbox.manager import SandboxManager

    _, client = farm
    job = _submit(client, KEY_B).get_json()["job_ids"][0]
    m = SandboxManager(r, "tenant-node", "local", root=str(tmp_path / "sbx"))
    boxes = [m.start(SandboxSpec(), job) for _ in range(2)]
    try:
        assert usage(r, ["team-b"])["team-b"]["sandboxes"] == 2
        resp = _submit(client, KEY_B)
        assert resp.status_code == 429 and "sandboxes" in resp.get_json()["error"]["message"]
    finally:
        for box in boxes:
            m.stop(box)
    assert usage(r, ["team-b"])["team-b"]["sandboxes"] == 0
    assert _submit(client, KEY_B).status_code == 202
    assert r.hlen(keys.sandbox_tenants("tenant-node")) == 0


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile
        return b"prorl_farm.graders.answers"


def _sleeping(seconds: str) -> int | None:
    """The pid of a ``sleep <seconds>`` on this host, if one runs."""
    wanted = b"sleep\0" + seconds.encode() + b"\0"
    with os.scandir("/proc") as entries:
        pids = [int(e.name) for e in entries if e.name.isdigit()]
    return next((pid for pid in pids if _cmdline(pid) == wanted), None)


def _cpu_line(text: str) -> str:
    """The cpu controller's path in a /proc/<pid>/cgroup text (cgroup v1)."""
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return ""


@pytest.mark.slow
def test_a_tenants_sandboxes_and_graders_take_cpu_by_its_weight(redis_server, r, tmp_path):
    """Real pools (root) with two tenants of weights 3 and 1: every process a node starts
    for a job (its RUN sandbox, its grading sandbox, the answer-grading helper while it grades
    for it) is in its tenant's CPU group, whose cpu.shares is 1024 times the weight, so a
    contended node gives each tenant's work CPU by weight, not by how many processes it
    started."""
    import uuid

    from api import create_app
    from prorl_farm.sandbox import cgroups
    from tests.conftest import make_pools

    if cgroups._CPU_BASE is None:
        pytest.skip("no cgroup v1 cpu controller writable here (not root, or cgroup v2)")
    tag = uuid.uuid4().hex[:6]
    heavy, light = f"heavy-{tag}", f"light-{tag}"
    tenants = {heavy: {"token": KEY_A, "weight": 3}, light: {"token": KEY_B}}
    (tmp_path / "pools").mkdir()
    node = f"cpunode{tag}"
    pools = make_pools(redis_server, tmp_path / "pools", api_token=OPERATOR,
                       tenants=json.dumps(tenants), node=node)
    app = create_app(load_settings(farm_env(redis_server.url, api_token=OPERATOR,
                                            tenants=json.dumps(tenants))))
    pools.start()
    groups = {}
    # The groups of this farm's node: another farm on this host (or another node) has its own.
    farm = cgroups.farm_cpu_id(redis_server.url, node)
    try:
        client = app.test_client()
        for seq, (tenant, key) in enumerate(((heavy, KEY_A), (light, KEY_B))):
            groups[tenant] = cgroups.tenant_cpu(tenant, tenants[tenant].get("weight", 1),
                                                farm)
            where = "/" + str(groups[tenant].relative_to(cgroups._CPU_BASE))
            # The sandbox's own view of its cgroups is a namespace's: looked at from here.
            # Durations no other test's process sleeps (the suite runs side by side).
            unique = int(tag, 16) % 1_000_000
            run_s, check_s = f"60{seq}.{unique:06d}", f"70{seq}.{unique:06d}"
            shell = {"commands": [f"sleep {run_s}"], "check": f"sleep {check_s}; true"}
            math = {"problem": "2 + 2?", "answer": "4", "tools": []}
            subs = []
            for handler, inst in (("shell", shell), ("math", math)):
                resp = client.post("/v1/jobs", headers=_auth(key), json={
                    "handler": handler, "instances": [inst], "mode": "reference"
                    if handler == "math" else "policy", "deadline_s": 300})
                assert resp.status_code == 202, resp.get_json()
                subs.append(resp.get_json())
            # The RUN sandbox's command, then the grading sandbox's check, each in its group.
            for seconds in (run_s, check_s):
                pid = wait_until(lambda s=seconds: _sleeping(s), 120, 0.2, f"sleep {seconds}")
                with open(f"/proc/{pid}/cgroup") as f:
                    assert _cpu_line(f.read()) == where, seconds
                os.kill(pid, signal.SIGKILL)  # the command goes on
            jobs = []
            for sub in subs:
                wait_until(lambda s=sub, k=key: client.get(
                    f"/v1/batches/{s['batch_id']}", headers=_auth(k)).get_json()["complete"],
                    120, 0.2, f"{tenant}'s job")
                jobs.append(client.get(f"/v1/jobs/{sub['job_ids'][0]}",
                                       headers=_auth(key)).get_json())
            assert [j["state"] for j in jobs] == ["done", "done"], [j["failure"] for j in jobs]
            assert jobs[1]["reward"] == 1.0
            # Once the job's sandboxes are stopped, the group holds the helper that graded
            # its answer (it stays until it grades for another tenant) and nothing else: no
            # process of the farm's own.
            def helpers_only(group=groups[tenant]) -> bool:
                cmdlines = [_cmdline(pid) for pid in cgroups.pids(group)]
                return bool(cmdlines) and all(b"prorl_farm.graders.answers" in c
                                              for c in cmdlines)
            wait_until(helpers_only, 30, 0.2, f"{tenant}'s group to hold only its helper")
            assert (groups[tenant] / "cpu.shares").read_text().strip() == \
                str(1024 * tenants[tenant].get("weight", 1))
        # The farm's node weighs, against the host's other processes, one busy process per CPU.
        assert (cgroups.farm_cpu_group(farm) / "cpu.shares").read_text().strip() == \
            str(1024 * len(os.sched_getaffinity(0)))
        pools.stop()
        # Its last pool gone, the node's groups are too: none is left on the host.
        assert not cgroups.farm_cpu_group(farm).exists()
    finally:
        app.extensions["prorl"].close()  # its Redis and broker connections
        pools.stop()
        for group in groups.values():
            if group is not None:
                cgroups.kill_all_and_remove(group)
