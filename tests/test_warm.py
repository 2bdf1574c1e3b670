"""Warm sandboxes (worker/warm.py): a node's INIT pool builds sandboxes ahead for the jobs
waiting for INIT, a job's INIT adopts one of its instance instead of building its own, and
no file, process or environment variable of one job reaches another; what is left unused
stops. Real pools, real sandboxes."""

from __future__ import annotations

from prorl_farm import keys
from prorl_farm.fair_view import warm_stats
from tests.farm import http_farm, wait_until

# Each job looks for what an earlier job would have left (a file in its workspace and in
# /tmp, a process, an exported variable), says whether it found any, then leaves all three.
LOOK = ("if test -e marker || test -e /tmp/marker || test -n \"${LEAK:-}\" || "
        "grep -qs 'sleep 4242' /proc/[0-9]*/cmdline; then echo dirty > result; "
        "else echo clean > result; fi")
LEAVE = "touch marker /tmp/marker; (sleep 4242 &); export LEAK=1; true"
INSTANCE = {"files": {"README": "warm\n"}, "setup": ["echo ready > setup.txt"],
            "commands": [LOOK, LEAVE], "check": "grep -qx clean result && test -e setup.txt"}


def test_warm_sandboxes_serve_one_job_each_and_nothing_survives(redis_server, r, tmp_path):
    with http_farm(redis_server.url, tmp_path, "warm", warm_pool=4, warm_ttl_s=20,
                   init_concurrency=1, fair_reserve=0) as (url, env):
        from prorl_farm.trainer import FarmClient

        client = FarmClient(url)
        node = env["PRORL_NODE"]
        sub = client.submit("shell", [INSTANCE], n=12)
        wait_until(lambda: client.batch(sub["batch_id"])["complete"], 120, 0.1, "the batch")
        jobs = [client.job(j) for j in sub["job_ids"]]
        assert [j["state"] for j in jobs] == ["done"] * 12, [j.get("error") for j in jobs]
        # Every job found a sandbox nobody had used, warm or not.
        assert [j["reward"] for j in jobs] == [1.0] * 12
        stats = warm_stats(r)[node]
        assert stats["hit"] >= 4, stats  # INIT took warm sandboxes (one slot, 12 jobs)
        # Nothing of the jobs is left; warm sandboxes nobody took stop within their time.
        wait_until(lambda: not r.hlen(keys.sandbox_records(node)), 40, 0.2,
                   "every sandbox stopped")
        assert not r.hlen(keys.warm(node))
        assert not r.hlen(keys.sandbox_slots(node))
        assert int(r.hget(keys.tenant("default"), "sandboxes") or 0) == 0
