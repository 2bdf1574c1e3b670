"""Submission at trainer scale: a batch and its INIT messages land in one transaction.

An 8,192-job request (512 instances x n=16) is written whole or not at all: cut the
connection to Redis part-way through the write, or run Redis out of memory in the middle
of it, and no job, message, batch or counter of it is left behind, while a batch submitted
before stays as it was. The messages the job store writes itself are the ones Celery's
``send_task`` would push (compared field by field), so workers take them as any other.
"""

from __future__ import annotations

import base64
import json
import socket
import threading

import pytest
import redis

from prorl_farm import keys
from prorl_farm.celery_app import create_celery_app
from prorl_farm.config import load_settings
from prorl_farm.jobs.messages import StageMessages
from tests.farm import RedisServer, TcpListener, farm_env, open_slots

BIG = {"handler": "synthetic", "instances": [{"run_s": 0.0, "reward": i % 2}
                                             for i in range(512)], "n": 16}


@pytest.fixture
def private(tmp_path):
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


def _app(url: str):
    from api import create_app

    return create_app(load_settings(farm_env(url)))


def _snapshot(r) -> tuple:
    """Every key with its type and size: what a submission could have changed (but the
    API's own request-latency metrics, which it flushes in the background)."""
    out = []
    for key in sorted(r.keys("*")):
        if key == keys.API_ROUTES or key.startswith(keys.histogram("api:")):
            continue
        kind = r.type(key)
        size = {"list": r.llen, "zset": r.zcard, "hash": r.hlen, "set": r.scard}.get(
            kind, lambda k: r.strlen(k))(key)
        out.append((key, kind, size, r.hgetall(key) if key == keys.STATE_COUNTS else None))
    return tuple(out)


def _message_args(raw: str) -> list:
    body = json.loads(raw)["body"]
    return json.loads(base64.b64decode(body))[0]


def test_an_8192_job_submission_lands_whole_with_its_messages(private):
    r = redis.Redis.from_url(private.url, decode_responses=True)
    open_slots(r)  # as a pool would: every message goes onto the queue
    resp = _app(private.url).test_client().post("/v1/jobs", json=BIG)
    assert resp.status_code == 202, resp.get_json()
    body = resp.get_json()
    ids = body["job_ids"]
    assert len(ids) == len(set(ids)) == 8192
    # One INIT message per job, in submission order (kombu pops from the right), each
    # carrying the job's current token as its task id.
    raw = r.lrange("init", 0, -1)[::-1]
    assert [_message_args(m)[0] for m in raw] == ids
    pipe = r.pipeline()
    for job_id in ids:
        pipe.hmget(keys.job(job_id), "token", "state", "batch_id", "instance_index",
                   "sample_index")
    rows = pipe.execute()
    for job_id, (token, state, batch, index, sample), m, k in zip(ids, rows, raw,
                                                                   range(len(ids))):
        assert (state, batch) == ("queued", body["batch_id"])
        assert (int(index), int(sample)) == divmod(k, 16)
        assert _message_args(m) == [job_id, token]
        assert json.loads(m)["headers"]["id"] == token
    # Recorded on the queue's index (the reaper's lost-message check), counted once.
    assert r.zcard(keys.queued("init")) == 8192
    assert r.hget(keys.STATE_COUNTS, "queued") == "8192"
    assert r.hget(keys.batch(body["batch_id"]), "total") == "8192"


def test_the_messages_are_the_ones_send_task_pushes(private):
    r = redis.Redis.from_url(private.url, decode_responses=True)
    app = create_celery_app(load_settings(farm_env(private.url)))
    for stage, queue in (("init", "init"), ("run", "run.n1"), ("eval", "eval.n1")):
        app.send_task(f"prorl.{stage}", args=["j" * 32, "t" * 32], queue=queue,
                      task_id="t" * 32)
        sent = json.loads(r.rpop(queue))
        ours = json.loads(StageMessages(app).payload(stage, queue, "j" * 32, "t" * 32))
        # Per message or per process, by design: the delivery tag (unique per message),
        # the reply queue's name and the sender's name.
        for msg in (sent, ours):
            assert msg["properties"].pop("delivery_tag")
            msg["properties"].pop("reply_to")
            msg["headers"].pop("origin")
        assert ours == sent
        assert base64.b64decode(ours["body"]) == base64.b64decode(sent["body"])


class CuttingProxy(TcpListener):
    """A TCP proxy to Redis that drops a connection once more than ``limit`` bytes went
    from the client to the server over it: a network or a host failing mid-write."""

    def __init__(self, upstream_port: int, limit: int):
        self.upstream_port, self.limit = upstream_port, limit
        self.cuts = 0
        super().__init__()

    def handle(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.upstream_port))
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()
        self._pump(client, server, True)

    def _pump(self, src, dst, upstream: bool) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if upstream and sent + len(data) > self.limit:
                    dst.sendall(data[:self.limit - sent])  # part of it reaches Redis
                    self.cuts += 1
                    break
                sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@pytest.mark.parametrize("failure", ["connection cut mid-write", "out of memory mid-write"])
def test_a_failure_mid_write_leaves_no_job_behind(private, failure):
    r = redis.Redis.from_url(private.url, decode_responses=True)
    open_slots(r)
    direct = _app(private.url).test_client()
    before = direct.post("/v1/jobs", json={"handler": "synthetic", "instances": [{}], "n": 3})
    assert before.status_code == 202
    snapshot = _snapshot(r)
    proxy = None
    if failure.startswith("connection"):
        # A few MB into the request's one transaction (it writes about 12 MB).
        proxy = CuttingProxy(private.port, limit=4 << 20)
        client = _app(f"redis://127.0.0.1:{proxy.port}/0").test_client()
    else:
        client = direct
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", used + (4 << 20))
    try:
        resp = client.post("/v1/jobs", json=BIG)
    finally:
        if proxy:
            proxy.close()
        r.config_set("maxmemory", 0)
    assert resp.status_code == 503, resp.get_json()
    error = resp.get_json()["error"]
    assert error["code"] == ("redis_unavailable" if proxy else "redis_out_of_memory")
    assert error["message"]
    if proxy:
        assert proxy.cuts >= 1
    assert _snapshot(r) == snapshot  # not one job, message, instance or count of it
    # The earlier batch is untouched, and the same request goes through once Redis can.
    assert direct.get(f"/v1/batches/{before.get_json()['batch_id']}").get_json()["total"] == 3
    again = direct.post("/v1/jobs", json=BIG)
    assert again.status_code == 202
    assert r.llen("init") == 3 + 8192
