"""Fair share (lua/lib/fair.lua): each queue's slots go to the waiting tenant holding the
fewest per weight; past the shared slots only a tenant under its due gets one of the
reserve; within a tenant a higher priority goes first and aging stops starvation; every
way a job leaves (hand-off, end, cancel, re-queue) gives its slot back exactly. Against a
real Redis through the farm's own scripts, then a real farm's pools."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from prorl_farm import keys
from prorl_farm.celery_app import create_celery_app
from prorl_farm.jobs.messages import StageMessages
from prorl_farm.jobs.store import JobStore
from prorl_farm.states import JobState
from prorl_farm.worker.kombu import message_args


@pytest.fixture
def fair(settings, r):
    store = JobStore.from_settings(dataclasses.replace(settings, fair_aging_s=60.0))
    yield store, StageMessages(create_celery_app(settings))
    store.r.close()


def _register(store, queue="init", shared=2, reserve=2, weights=None):
    return store.fair_fill(queue, "pool-1", shared, reserve, 60, weights or {"a": 1, "b": 1})


def _submit(store, messages, tenant, n, batch=None, priority=0):
    return store.create_jobs(batch or f"b-{tenant}-{priority}-{time.monotonic_ns()}",
                             "synthetic", [{}], n, {}, None, messages=messages,
                             tenant=tenant, priority=priority)


def _on_list(r, queue="init") -> list[str]:
    """The jobs whose message is on the queue, oldest push first."""
    return [message_args(json.loads(m))[0] for m in r.lrange(queue, 0, -1)[::-1]]


def _held(r, queue="init", by="tenant") -> dict:
    """Slots held, by tenant (or by flow: one batch's jobs), and ``*``: all of them."""
    out: dict[str, int] = {}
    for k, v in r.hgetall(keys.held(queue)).items():
        name = k if by == "flow" else keys.flow_tenant(k)
        if name is not None and not name.startswith("#") and int(v):
            out[name] = out.get(name, 0) + int(v)
            out["*"] = out.get("*", 0) + int(v)
    return out


def _penned(r, queue="init", tenant="a") -> list[str]:
    """The tenant's jobs waiting in its pens for a slot of ``queue``."""
    return [job for flow in sorted(r.smembers(keys.pen_flows(queue)))
            if keys.flow_tenant(flow) == tenant
            for job in r.zrange(keys.pen(queue, flow), 0, -1)]


def _take(store, r, job, queue="init"):
    """A worker pops the job's message and claims it."""
    r.lrem(queue, 1, next(m for m in r.lrange(queue, 0, -1)
                          if message_args(json.loads(m))[0] == job.job_id))
    assert store.claim(job.job_id, "init", job.token, "w")[0] == "ok"


def test_a_tenant_alone_takes_every_shared_slot_and_no_reserve(fair, r):
    store, messages = fair
    _register(store)
    jobs = _submit(store, messages, "a", 6)
    assert _on_list(r) == [j.job_id for j in jobs[:2]]
    assert _held(r) == {"a": 2, "*": 2}
    # As each ends, the next of its jobs takes the slot, in order.
    _take(store, r, jobs[0])
    store.finish(jobs[0].job_id, JobState.DONE, token=jobs[0].token)
    assert _on_list(r) == [jobs[1].job_id, jobs[2].job_id]
    assert _held(r) == {"a": 2, "*": 2}


def test_a_tenant_behind_a_flood_starts_at_once_from_the_reserve(fair, r):
    store, messages = fair
    _register(store, shared=4, reserve=4)
    flood = _submit(store, messages, "a", 20)
    step = _submit(store, messages, "b", 5)
    # b is due half the shared slots (equal weights): two of its jobs start now, beside a's 4.
    assert _on_list(r)[4:] == [j.job_id for j in step[:2]]
    assert _held(r) == {"a": 4, "b": 2, "*": 6}
    # While a holds more than its due, its ended jobs' slots go to b, not back to a.
    for job in flood[:2]:
        _take(store, r, job)
        store.finish(job.job_id, JobState.DONE, token=job.token)
    assert _held(r)["b"] == 2 and _held(r)["a"] == 2  # 4 held: back within the shared
    _take(store, r, flood[2])
    store.finish(flood[2].job_id, JobState.DONE, token=flood[2].token)
    # Even shares now: the freed shared slot goes to whoever holds fewer, here a again.
    assert _held(r) == {"a": 2, "b": 2, "*": 4}


def test_weights_set_the_shares(fair, r):
    store, messages = fair
    _register(store, shared=6, reserve=0, weights={"a": 2, "b": 1})
    a_jobs = _submit(store, messages, "a", 20)
    b_jobs = _submit(store, messages, "b", 20)
    for job in a_jobs[:6]:  # a's first six end: the slots go by held per weight
        _take(store, r, job)
        store.finish(job.job_id, JobState.DONE, token=job.token)
    assert _held(r) == {"a": 4, "b": 2, "*": 6}
    assert b_jobs  # still waiting


def test_a_tenants_batches_of_one_priority_share_its_slots(fair, r):
    """Within a tenant, a batch behind another's backlog (a second step, an evaluation of
    the same priority) gets the freed slots until it holds as many, then they alternate;
    a batch of higher priority takes them all."""
    store, messages = fair
    _register(store, shared=4, reserve=4)
    backlog = _submit(store, messages, "a", 20, batch="backlog")
    step = _submit(store, messages, "a", 6, batch="step")
    assert _on_list(r) == [j.job_id for j in backlog[:4]]  # a tenant alone: no reserve

    def end(job):
        _take(store, r, job)
        store.finish(job.job_id, JobState.DONE, token=job.token)

    backlog_flow, step_flow = "a|0|backlog", "a|0|step"  # <tenant>|<head start>|<batch>
    for job in backlog[:2]:
        end(job)
    assert _held(r, by="flow") == {backlog_flow: 2, step_flow: 2, "*": 4}
    end(backlog[2])  # even: the next goes to the one whose head came first, the backlog
    assert _held(r, by="flow") == {backlog_flow: 2, step_flow: 2, "*": 4}
    assert _on_list(r)[-1] == backlog[4].job_id
    end(step[0])
    assert _on_list(r)[-1] == step[2].job_id
    # A batch of higher priority goes before both, however many slots it holds.
    urgent = _submit(store, messages, "a", 5, batch="urgent", priority=1)
    for job in (backlog[3], backlog[4], step[1], step[2]):
        end(job)
    assert _on_list(r) == [j.job_id for j in urgent[:4]]
    assert _held(r) == {"a": 4, "*": 4}


def test_priority_goes_first_within_a_tenant_and_aging_stops_starvation(fair, r):
    store, messages = fair
    _register(store, shared=1, reserve=0)
    first = _submit(store, messages, "a", 1)
    low = _submit(store, messages, "a", 3)
    high = _submit(store, messages, "a", 2, priority=2)
    order = []
    holder = first[0]
    for _ in range(5):
        _take(store, r, holder)
        store.finish(holder.job_id, JobState.DONE, token=holder.token)
        [next_id] = _on_list(r)
        order.append(next_id)
        holder = next(j for j in low + high if j.job_id == next_id)
    assert order == [j.job_id for j in high + low]
    # A job of priority 0 that waited longer than the aging time per level goes before a
    # newer one of priority 1.
    aged = JobStore.from_settings(dataclasses.replace(store.settings, fair_aging_s=0.2))
    old = _submit(aged, messages, "a", 1)
    time.sleep(0.3)
    newer = _submit(aged, messages, "a", 1, priority=1)
    _take(store, r, holder)
    store.finish(holder.job_id, JobState.DONE, token=holder.token)
    assert _on_list(r) == [old[0].job_id]
    assert newer
    aged.r.close()


def test_every_way_out_gives_the_slot_back_and_leaves_nothing(fair, r):
    """Hand-off, end, cancel while waiting, re-queue by the reaper: the counters come back to
    zero and no pen, message or slot mark is left."""
    store, messages = fair
    _register(store, shared=2, reserve=2)
    _register(store, queue="run.n", shared=1, reserve=0)
    jobs = _submit(store, messages, "a", 4) + _submit(store, messages, "b", 2)
    first, second = jobs[0], jobs[1]
    _take(store, r, first)
    token = store.advance(first.job_id, "init", first.token, "run", "run.n", "n", "hstate",
                          "{}", messages)
    assert _held(r, "run.n") == {"a": 1, "*": 1}
    assert store.claim(first.job_id, "run", token, "w")[0] == "ok"
    store.finish(first.job_id, JobState.DONE, token=token)
    # A job waiting in a pen, cancelled; a job holding a slot, cancelled.
    waiting = jobs[3]
    assert waiting.job_id in _penned(r)
    store.finish(waiting.job_id, JobState.CANCELLED, "cancelled", "by the test")
    assert r.hget(keys.pen_messages("init"), waiting.job_id) is None
    store.finish(second.job_id, JobState.CANCELLED, "cancelled", "by the test")
    # A job whose worker died, re-queued at INIT.
    third = jobs[2]
    _take(store, r, third)
    r.zadd(keys.ACTIVE, {third.job_id: 0})
    outcome, _ = store.reap(third.job_id, "active", time.time(), third.token, "", "dead",
                            messages)
    assert outcome.value == "requeue"
    for job in jobs:
        if store.state_of(job.job_id) not in ("done", "cancelled"):
            store.finish(job.job_id, JobState.CANCELLED, "cancelled", "by the test")
    for queue in ("init", "run.n"):
        assert _held(r, queue) == {}, queue
        assert not r.exists(keys.pen_flows(queue), keys.pen_messages(queue))
    assert not any(r.hget(keys.job(j.job_id), "slot") for j in jobs)


def test_without_pools_jobs_wait_in_their_pens_and_a_pool_takes_them(fair, r):
    store, messages = fair
    jobs = _submit(store, messages, "a", 3)
    assert r.llen("init") == 0 and len(_penned(r)) == 3
    assert store.waiting_in_pens("init") == [j.job_id for j in jobs]
    assert _register(store, shared=8, reserve=0) == 3
    assert _on_list(r) == [j.job_id for j in jobs]
    # A pool that leaves takes its slots away; one whose registration lapsed counts none.
    assert store.fair_fill("init", "pool-1", 0, 0, 60, {}) == 0
    assert not r.hlen(keys.slots("init"))
    store.fair_fill("init", "pool-2", 5, 0, -1, {})
    store.fair_fill("init", "pool-3", 1, 2, 60, {})
    assert list(r.hgetall(keys.slots("init"))) == ["pool-3"]
    assert r.hmget(keys.held("init"), "#shared", "#reserve") == ["1", "2"]


def test_a_pen_of_a_node_whose_pool_is_not_up_yet_waits_the_stale_time(fair, r, settings):
    """A node's INIT pool may hand jobs to its RUN queue before that node's RUN pool has
    started: with no slots they wait in the pen, and the reaper lets them wait the stale time
    from their arrival (as it does a job on a list), not fail them at its next look."""
    from prorl_farm.worker.reaper import Reaper

    store, messages = fair
    settings = dataclasses.replace(settings, heartbeat_stale_s=0.5, max_requeues=0)
    store.settings = settings
    reaper = Reaper(store, settings, messages)
    _register(store, shared=2, reserve=0)
    [job] = _submit(store, messages, "a", 1)
    _take(store, r, job)
    store.advance(job.job_id, "init", job.token, "run", "run.n", "n", "hstate", "{}",
                  messages)
    assert store.waiting_in_pens("run.n") == [job.job_id]
    assert "failed" not in reaper.sweep(force=True)
    assert store.state_of(job.job_id) == "run"
    time.sleep(0.6)  # no RUN pool came within the stale time: the job is lost to it
    assert reaper.sweep(force=True).get("failed") == 1
    raw = store.get_raw(job.job_id)
    assert raw["state"] == "failed" and "no live run pool on node n" in json.dumps(raw)


def test_a_real_farm_serves_a_step_behind_another_tenants_flood(redis_server, r, tmp_path):
    """Real pools: tenant a fills EVAL with slow answers, then b submits a quick step. b's
    step completes while nearly all of a's flood still waits (first come, first served, it
    would wait for all of it); then the flood finishes too."""
    from prorl_farm.trainer import FarmClient
    from tests.farm import http_farm, wait_until

    key_a, key_b = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
    tenants = {"a": {"token": key_a}, "b": {"token": key_b}}
    with http_farm(redis_server.url, tmp_path, "fair", tenants=json.dumps(tenants),
                   eval_concurrency=2) as (url, env):
        a, b = FarmClient(url, token=key_a), FarmClient(url, token=key_b)
        queue = f"eval.{env['PRORL_NODE']}"
        flood = a.submit("synthetic", [{"eval_s": 2.0}], n=12)["batch_id"]
        wait_until(lambda: _held(r, queue).get("a") == 2, 30, what="a's flood in EVAL")
        step = b.submit("synthetic", [{"eval_s": 0.01}], n=6)["batch_id"]
        wait_until(lambda: b.batch(step)["complete"], 60, 0.05, "b's step")
        assert b.batch(step)["counts"]["done"] == 6
        assert a.batch(flood)["counts"]["done"] <= 4, a.batch(flood)
        given = r.hgetall(keys.FAIR_GIVEN)
        assert int(given.get("eval:b:reserve", 0)) >= 1, given
        wait_until(lambda: a.batch(flood)["complete"], 60, 0.2, "a's flood")
        assert a.batch(flood)["counts"]["done"] == 12
        wait_until(lambda: _held(r, queue) in ({}, {"*": 0}), 10, what="every slot back")


def _after_first_read_of(store, queue, then):
    """Run ``then()`` once, right after the first read of what waits on ``queue`` (the list's
    index or the one-step sweep of list and pens) returns: a deterministic interleaving of
    another process's write between a leaving pool's reads."""
    import hashlib

    from prorl_farm import lua

    try:
        sweep_sha = hashlib.sha1(lua.source("leave_sweep").encode()).hexdigest()
    except KeyError:
        sweep_sha = None
    original = store.r.execute_command
    fired = []

    def execute(*args, **options):
        out = original(*args, **options)
        reads = ((args[0] == "ZRANGE" and args[1] == keys.queued(queue))
                 or (args[0] == "EVALSHA" and args[1] == sweep_sha))
        if reads and not fired:
            fired.append(True)
            then()
        return out

    store.r.execute_command = execute
    return fired


def _on_run_n(store, messages, r, tenant="a", n=1):
    """``n`` jobs of ``tenant`` through INIT and handed to queue run.n."""
    jobs = _submit(store, messages, tenant, n)
    for job in jobs:
        _take(store, r, job)
    return [(job, store.advance(job.job_id, "init", job.token, "run", "run.n", "n", "h",
                                "{}", messages)) for job in jobs]


def test_a_leaving_pool_hands_back_a_job_moved_from_a_pen_onto_the_list_as_it_reads(
        fair, r, settings):
    """Issue: a pool leaving its node read its queue's list, then its pens; a slot given
    between the two reads (here: a pool beat's registration racing with the leave's
    withdrawal) moved a pen job onto the list, in neither read, and it waited there for
    ever. The sweep reads both in one step and again until a read finds nothing; a job that
    enters the queue after its last read (a stage ending on the node as its pools stop) the
    reaper hands back at its next look, without the stale time or a re-queue spent."""
    from prorl_farm.worker.pool import hand_back_waiting
    from prorl_farm.worker.reaper import Reaper

    store, messages = fair
    settings = dataclasses.replace(settings, heartbeat_stale_s=120.0, max_requeues=0)
    store.settings = settings
    _register(store, shared=8, reserve=0)  # INIT
    store.fair_fill("run.n", "pool-1", 1, 0, 60, {})
    jobs = [job for job, _ in _on_run_n(store, messages, r, n=3)]
    assert _on_list(r, "run.n") == [jobs[0].job_id]
    assert _penned(r, "run.n") == [j.job_id for j in jobs[1:]]
    r.zadd(keys.POOLS, {"run:n": store.server_time()})
    # The leave: slots withdrawn; as it reads, the racing beat registers them again.
    store.fair_fill("run.n", "pool-1", 0, 0, 60, {})
    fired = _after_first_read_of(
        store, "run.n", lambda: store.fair_fill("run.n", "pool-1", 2, 0, 60, {}))
    n = hand_back_waiting(store, messages, "run", "n")
    assert fired and n == 3
    # A job that INIT hands to the queue after the leave's last read.
    del store.r.execute_command
    store.fair_fill("run.n", "pool-1", 0, 0, 60, {})
    late = [job for job, _ in _on_run_n(store, messages, r, tenant="b")]
    r.zrem(keys.POOLS, "run:n")  # the pool is gone (its last act)
    counts = Reaper(store, settings, messages).sweep(force=True)
    assert counts.get("requeue") == 1 and "failed" not in counts
    for job in jobs + late:
        raw = store.get_raw(job.job_id)
        assert (raw["state"], raw["queue"], raw["requeues"]) == ("queued", "init", "0"), raw
        assert "node n left" in raw["attempts"]
    assert store.leave_sweep("run.n", mark=False) == []
    # The mark stays while a job could still arrive in time for it, then the reaper drops
    # it (a node that never comes back leaves nothing behind).
    assert r.hexists(keys.LEFT, "run.n")
    r.hset(keys.LEFT, "run.n", str(store.server_time() - 3 * settings.heartbeat_stale_s))
    Reaper(store, settings, messages).sweep(force=True)
    assert not r.hexists(keys.LEFT, "run.n")
    # A pool that serves the queue again clears its mark.
    store.leave_sweep("run.n", mark=True)
    assert r.hexists(keys.LEFT, "run.n")
    store.fair_fill("run.n", "pool-2", 1, 0, 60, {})
    assert not r.hexists(keys.LEFT, "run.n")


def test_a_pool_beat_after_the_leave_registers_nothing(settings, r):
    """The leave withdraws the pool's slots from a thread of its own while the liveness
    thread still beats: a beat after it (or one that had read the slots just before it)
    must not register them again, or the pick hands the queue's pen jobs to no pool."""
    from prorl_farm.worker.liveness import Liveness

    store = JobStore.from_settings(settings)
    live = Liveness(store, settings, "run")
    live.slots = ("run.n", 2, 0)
    live.register_slots()
    assert list(r.hgetall(keys.slots("run.n"))) == [live.presence.name]
    live.register_slots(leaving=True)
    live.slots = ("run.n", 2, 0)  # a ready signal that came late
    live.register_slots()
    assert not r.hlen(keys.slots("run.n"))
    live.presence.close()
