"""Redis Sentinel under the farm: the primary killed with SIGKILL mid-batch, its replica
promoted, every process following it by itself, nothing lost or finished twice."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.farm import Pools, farm_env, sandbox_root, wait_until
from tests.test_faults import _check_exact

# A private trio and farm; its timings (heartbeats stale at 10 s, a failover in ~2 s) hold
# on a loaded machine: it runs beside the suite's other tests.
pytestmark = pytest.mark.slow

SHELL = {"commands": ["sleep 0.2; echo $((6 * 7)) > out.txt"],
         "check": "test \"$(cat out.txt)\" = 42"}


def test_sigkill_of_the_redis_primary_mid_batch_fails_over_to_its_replica_losing_nothing(
        tmp_path):
    """A primary, a replica and three sentinels under the farm (PRORL_REDIS_URL a Sentinel
    URL); a batch of shell jobs, each in two sandboxes; kill -9 of the primary mid-batch.
    The sentinels promote the replica, every process follows it by itself (no pool exits),
    and every job ends done, once in the result stream, none lost."""
    from api import create_app
    from prorl_farm.config import load_settings
    from prorl_farm.redis_ha import RedisHA

    ha = RedisHA(tmp_path / "ha", down_after_ms=1000, failover_timeout_ms=5000)
    members = {}
    for m in ha.members():
        with open(m.log, "ab") as log:
            members[m.name] = subprocess.Popen(m.argv, stdout=log, stderr=subprocess.STDOUT)
    pools = app = None
    try:
        ha.wait_ready(60)
        first = ha.primary()
        env = farm_env(ha.url, heartbeat_stale_s=10, heartbeat_interval_s=0.2,
                       reap_interval_s=0.5, init_concurrency=8, run_concurrency=16,
                       eval_concurrency=8, sandbox_dir=sandbox_root(f"ha-{os.getpid()}"))
        pools = Pools(env, tmp_path)
        pools.start()
        app = create_app(load_settings(env))
        client = app.test_client()
        r = pools.r
        resp = client.post("/v1/jobs", json={"handler": "shell", "instances": [SHELL],
                                             "n": 200})
        assert resp.status_code == 202, resp.get_json()
        sub = resp.get_json()
        batch = f"/v1/batches/{sub['batch_id']}"
        wait_until(lambda: client.get(batch).get_json()["finished"] >= 40, 120,
                   what="40 jobs finished")
        killed_at = time.time()
        members[f"redis-{first}"].kill()
        wait_until(lambda: client.get(batch).get_json()["complete"], 240, 0.2, "the batch")
        assert ha.primary() not in (None, first)
        assert {stage: p.poll() for stage, p in pools.procs.items()} == \
            {stage: None for stage in pools.procs}, "a pool exited at the failover"
        jobs = _check_exact(client, r, [sub])
        after = sorted(j["finished_at"] for j in jobs if j["finished_at"] > killed_at)
        requeued = sum(j["requeues"] > 0 for j in jobs)
        print(f"\nkill -9 of the Redis primary: first job finished {after[0] - killed_at:.1f} s "
              f"after, the batch {after[-1] - killed_at:.1f} s after; {requeued} of "
              f"{len(jobs)} jobs re-queued")
    finally:
        if pools is not None:
            pools.stop()
        if app is not None:
            app.extensions["prorl"].store.r.close()
        for p in members.values():
            p.kill()
            p.wait()
        shutil.rmtree(sandbox_root(f"ha-{os.getpid()}"), ignore_errors=True)


def test_a_sentinel_url_is_read_or_refused_with_what_is_wrong():
    from prorl_farm.config import load_settings
    from prorl_farm.errors import ConfigError
    from prorl_farm.redisconn import celery_broker, parse

    t = parse("redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2/farm/3?sentinel_password=s")
    assert (t.sentinels, t.service, t.db, t.password, t.sentinel_password) == (
        (("10.0.0.1", 26379), ("10.0.0.2", 26379)), "farm", 3, "pw", "s")
    assert "pw" not in t.shown() and t.ha
    assert celery_broker(t.url) == (
        "sentinel://:pw@10.0.0.1:26379/3;sentinel://:pw@10.0.0.2:26379/3",
        {"master_name": "farm", "sentinel_kwargs": {"password": "s"}})
    assert celery_broker("redis://h:1/0") == ("redis://h:1/0", {})
    for bad, why in [("redis+sentinel://h:1", "names its service"),
                     ("redis+sentinel://h:x/s", "not a number"),
                     ("redis+sentinel://h/s/a", "/SERVICE/DB"),
                     ("redis+sentinel://h/s?x=1", "unknown option"),
                     ("http://h/0", "scheme 'http'")]:
        with pytest.raises(ConfigError, match=why):
            load_settings({"PRORL_REDIS_URL": bad})
