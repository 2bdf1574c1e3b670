"""Trajectories at production size: the arrays out of Redis into the trajectory store, exact
both ways (JSON and the Arrow stream), acknowledged batches deleted, a full disk failing
new jobs ``storage_error`` with nothing stored lost, a pool killed mid-write leaving no
partial payload, and payloads served across an API restart."""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
import time

import numpy as np
import pytest

from prorl_farm import keys
from prorl_farm.columns import payload_table, read_page, table_payload
from prorl_farm.handlers.synthetic import synthetic_trajectory
from prorl_farm.jobs.payloads import DirectoryStore, StorageError
from prorl_farm.trainer import FarmClient
from tests.farm import (
    Pools,
    RedisServer,
    farm_env,
    free_port,
    gunicorn_api,
    run_batch,
    stop_process,
    store_dir,
    wait_until,
)

LONG = 32_768


def _long(tokens: int = LONG, **extra) -> dict:
    return {"trajectory_tokens": tokens, "prompt_tokens": 512, "trajectory_turns": 8, **extra}


def _same(got: dict, want: dict) -> None:
    """The arrays bit for bit, with the store's types."""
    for name, dtype in (("prompt_ids", np.int32), ("response_ids", np.int32),
                        ("response_mask", np.uint8)):
        a = np.asarray(got[name])
        assert np.array_equal(a, np.asarray(want[name], dtype=dtype)), name
    lp = np.asarray(got["response_logprobs"], dtype=np.float64)
    assert lp.tobytes() == np.asarray(want["response_logprobs"], np.float64).tobytes()
    assert got["turns"] == want["turns"]


def test_the_columns_round_trip_exactly_and_keep_float64_where_float32_would_round():
    traj = synthetic_trajectory("seed", 300, LONG, turns=4)
    table = payload_table(traj)
    assert str(table.schema.field("response_logprobs").type) == "list<item: float>"
    _same(table_payload(table), traj)
    # A backend whose logprobs are not float32 values (the dev server computes in float64):
    # kept as float64, every bit.
    traj["response_logprobs"] = [x / 3.0 for x in traj["response_logprobs"]]
    table = payload_table(traj)
    assert str(table.schema.field("response_logprobs").type) == "list<item: double>"
    _same(table_payload(table, as_lists=True), traj)


def test_a_write_is_atomic_and_a_dead_writers_leftovers_are_swept(tmp_path):
    store = DirectoryStore(tmp_path)
    ref = store.put("b1", "j1", "t1", synthetic_trajectory("x", 10, 100))
    assert ref["path"] == "b-b1/j1.t1.arrow" and os.path.getsize(tmp_path / ref["path"]) == \
        ref["bytes"]
    assert os.listdir(tmp_path / "b-b1") == ["j1.t1.arrow"]  # nothing temporary left
    leftover = tmp_path / "b-b1" / ".tmp-j1.t2.dead"
    leftover.write_bytes(b"half a payload")
    assert store.sweep_temporary(max_age_s=3600) == 0
    assert store.sweep_temporary(max_age_s=0) == 1 and not leftover.exists()
    assert store.delete_batch("b1") == (1, ref["bytes"]) and store.read_table(ref) is None
    with pytest.raises(StorageError, match="not a payload path"):
        store.read_table({"path": "../../etc/passwd"})
    assert DirectoryStore(tmp_path, min_free_bytes=1 << 62).usage()["free_bytes"] > 0
    with pytest.raises(StorageError, match="PRORL_STORE_MIN_FREE_MB"):
        DirectoryStore(tmp_path, min_free_bytes=1 << 62).put("b", "j", "t", {
            "prompt_ids": [1], "response_ids": [2]})


@pytest.mark.slow
def test_a_32k_trajectory_leaves_redis_and_comes_back_exact_as_json_and_arrow(pools, client,
                                                                               r):
    (job,) = run_batch(client, {"handler": "synthetic", "instances": [_long()]})
    assert job["state"] == "done", job
    want = synthetic_trajectory(job["id"], 512, LONG, 8)
    _same(job["result"], want)
    assert job["result"]["response_len"] == LONG and job["result"]["num_turns"] == 8
    # Redis holds the summary only: its hash stays small whatever the length.
    # Redis holds the summary only: the job's record is the size of a 64-token one's.
    (small,) = run_batch(client, {"handler": "synthetic", "instances": [_long(64)]})
    sizes = [r.memory_usage(keys.job(j["id"])) for j in (job, small)]
    assert sizes[0] < 4096 and abs(sizes[0] - sizes[1]) <= 16, sizes
    assert len(r.hget(keys.job(job["id"]), "result")) < 600
    path = os.path.join(store_dir(pools.env["PRORL_REDIS_URL"]),
                        job["result"]["payload"]["path"])
    assert os.path.getsize(path) / LONG < 10  # bytes per response token on disk

    resp = client.get(f"/v1/batches/{job['batch_id']}/results",
                      headers={"Accept": "application/vnd.apache.arrow.stream"})
    assert resp.status_code == 200 and resp.mimetype == "application/vnd.apache.arrow.stream"
    jobs, meta = read_page(resp.data)
    assert meta["complete"] and meta["total"] == 1 and meta["cursor"] != "0-0"
    got = jobs[0]["result"]
    assert got["response_ids"].dtype == np.int32 and got["response_mask"].dtype == np.uint8
    assert got["response_logprobs"].dtype == np.float32
    _same(got, want)
    assert jobs[0]["reward"] == 1.0 and jobs[0]["id"] == job["id"]
    # JSON stays the default.
    page = client.get(f"/v1/batches/{job['batch_id']}/results").get_json()
    _same(page["results"][0]["result"], want)


@pytest.mark.slow
def test_an_acknowledged_batch_is_gone_from_disk_and_redis(pools, client, r):
    root = store_dir(pools.env["PRORL_REDIS_URL"])
    # The module's earlier batches lost their records with the keys `r` cleared: the reaper
    # sweeps their payloads (and counts them out) first, then the counts start from zero.
    wait_until(lambda: not glob.glob(f"{root}/b-*"), 60, 0.2, "earlier payloads swept")
    r.delete(keys.PAYLOAD_STATS)
    jobs = run_batch(client, {"handler": "synthetic", "instances": [_long(4096)], "n": 3})
    batch = jobs[0]["batch_id"]
    assert len(glob.glob(f"{root}/b-{batch}/*.arrow")) == 3
    stats = r.hgetall(keys.PAYLOAD_STATS)
    assert int(stats["files"]) == 3 and r.zscore(keys.PAYLOAD_BATCHES, batch) is not None
    overview = client.get("/v1/overview").get_json()["trajectories"]
    assert overview["files"] == 3 and overview["oldest_unacked"]["batch_id"] == batch

    resp = client.post(f"/v1/batches/{batch}/ack")
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["payloads_deleted"] == 3
    assert not os.path.exists(f"{root}/b-{batch}")
    assert int(r.hget(keys.PAYLOAD_STATS, "files")) == 0
    assert r.zscore(keys.PAYLOAD_BATCHES, batch) is None
    doc = client.get(f"/v1/jobs/{jobs[0]['id']}").get_json()
    assert doc["result"]["payload"]["deleted"] is True and "response_ids" not in doc["result"]
    assert doc["reward"] == 1.0  # the summary stays to the TTL
    assert client.post(f"/v1/batches/{batch}/ack").status_code == 200  # idempotent

    # An incomplete batch is refused, with nothing deleted.
    sub = client.post("/v1/jobs", json={"handler": "synthetic", "instances": [
        {"run_s": 30}]}).get_json()
    resp = client.post(f"/v1/batches/{sub['batch_id']}/ack")
    assert resp.status_code == 409 and resp.get_json()["error"]["code"] == "batch_incomplete"
    client.post(f"/v1/batches/{sub['batch_id']}/cancel")
    assert client.post("/v1/batches/nope/ack").status_code == 404


@pytest.mark.slow
def test_expired_batches_payloads_are_swept(pools, client, r):
    from prorl_farm.config import load_settings
    from prorl_farm.jobs.payloads import open_store
    from prorl_farm.jobs.store import JobStore
    from prorl_farm.worker.reaper import Reaper

    (job,) = run_batch(client, {"handler": "synthetic", "instances": [_long(1024)]})
    root = store_dir(pools.env["PRORL_REDIS_URL"])
    assert os.path.exists(f"{root}/b-{job['batch_id']}")
    r.delete(keys.batch(job["batch_id"]))  # as the result TTL does
    settings = load_settings(pools.env)
    store = JobStore.from_settings(settings)
    try:
        reaper = Reaper(store, settings, None, payloads=open_store(settings))
        assert reaper.sweep_payloads() >= 1
    finally:
        store.r.close()
    assert not os.path.exists(f"{root}/b-{job['batch_id']}")
    assert r.zscore(keys.PAYLOAD_BATCHES, job["batch_id"]) is None


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB filesystem of its own (tmpfs), for a store that fills up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0777", "tmpfs", str(mount)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root and tmpfs mounts to make a small disk")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@contextlib.contextmanager
def own_farm(tmp_path, **settings):
    """A farm of its own (Redis, pools, API client): its store is not the session farm's."""
    from api import create_app
    from prorl_farm.config import load_settings

    server = RedisServer(tmp_path / "redis")
    pools = Pools(farm_env(server.url, store_min_free_mb=0, **settings), tmp_path)
    app = create_app(load_settings(pools.env))
    try:
        pools.start()
        yield pools, app.test_client()
    finally:
        pools.stop()
        app.extensions["prorl"].store.r.close()
        server.stop()


@pytest.mark.slow
def test_a_full_disk_fails_new_jobs_storage_error_and_loses_nothing_stored(tmp_path,
                                                                           small_disk):
    with own_farm(tmp_path, store_dir=str(small_disk)) as (_, client):
        # About 290 KB each: the first few fit, the rest find the disk full.
        jobs = run_batch(client, {"handler": "synthetic", "instances": [_long()], "n": 12})
    done = [j for j in jobs if j["state"] == "done"]
    failed = [j for j in jobs if j["state"] == "failed"]
    assert done and failed and len(done) + len(failed) == 12
    for job in failed:
        assert job["failure"]["kind"] == "storage_error", job["failure"]
        assert "disk full" in job["failure"]["message"] and job["reward"] is None
    for job in done:
        _same(job["result"], synthetic_trajectory(job["id"], 512, LONG, 8))
    assert not [p for p in glob.glob(f"{small_disk}/b-*/.*") if ".tmp-" in p]


@pytest.mark.slow
def test_a_pool_killed_mid_write_leaves_no_partial_payload_and_the_job_requeues(tmp_path):
    root = tmp_path / "store"
    with own_farm(tmp_path, store_dir=root, run_concurrency=1) as (pools, client):
        big = 3_000_000  # a file of about 27 MB: its write takes a while
        sub = client.post("/v1/jobs", json={"handler": "synthetic", "instances": [
            _long(big)]}).get_json()
        (job_id,) = sub["job_ids"]
        partial = wait_until(lambda: glob.glob(f"{root}/b-*/.tmp-*"), 60, 0.001,
                             "a payload being written")
        pools.kill("run")
        assert os.path.exists(partial[0])  # the half-written file, under its temporary name
        first_token = partial[0].split(".tmp-")[1].split(".")[1]
        pools.start("run")
        wait_until(lambda: client.get(f"/v1/jobs/{job_id}").get_json()["state"] in (
            "done", "failed"), 180, 0.2, "the re-queued job")
        job = client.get(f"/v1/jobs/{job_id}").get_json()
        assert job["state"] == "done" and job["requeues"] == 1, job
        assert first_token not in job["result"]["payload"]["path"]
        _same(job["result"], synthetic_trajectory(job_id, 512, big, 8))
        finals = glob.glob(f"{root}/b-*/*.arrow")
        assert [os.path.basename(p) for p in finals] == [
            os.path.basename(job["result"]["payload"]["path"])]


@pytest.mark.slow
def test_an_api_restart_still_serves_stored_payloads(pools, client, r, tmp_path):
    (job,) = run_batch(client, {"handler": "synthetic", "instances": [_long(8192)]})
    want = synthetic_trajectory(job["id"], 512, 8192, 8)
    env = farm_env(pools.env["PRORL_REDIS_URL"])
    for _ in range(2):
        port = free_port()
        api = gunicorn_api(env, port, tmp_path / "api.log")
        try:
            farm = FarmClient(f"http://127.0.0.1:{port}")
            wait_until(farm.ready, 30, 0.2, "api ready")
            (got,) = list(farm.iter_results(job["batch_id"], wait_s=0))
            _same(got["result"], want)
            assert got["result"]["response_ids"].dtype == np.int32
            (plain,) = farm.results(job["batch_id"], binary=False)["results"]
            _same(plain["result"], want)
            many = farm.results_many({job["batch_id"]: "0-0", "gone": "0-0"})
            _same(many[job["batch_id"]]["results"][0]["result"], want)
            assert many["gone"] == {"found": False}
            farm.http.close()
        finally:
            stop_process(api)
        time.sleep(0.2)
