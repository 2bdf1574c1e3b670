"""The job store's atomic transitions against a real Redis, without workers."""

from __future__ import annotations

import json
import threading

import pytest

from prorl_farm import counters, keys
from prorl_farm.celery_app import create_celery_app
from prorl_farm.jobs.messages import StageMessages
from prorl_farm.jobs.store import JobStore
from prorl_farm.states import ALL_STATES, JobState
from prorl_farm.worker.kombu import message_args
from tests.farm import open_slots

_STORES: list[JobStore] = []


@pytest.fixture(autouse=True)
def _close_stores():
    """Every store a test makes is closed with it (its pool's sockets with it)."""
    yield
    while _STORES:
        _STORES.pop().r.close()


def make(settings, r, n=1, **kw):
    store = JobStore.from_settings(settings)
    _STORES.append(store)
    for queue in ("init", "run.n", "eval.n"):
        open_slots(r, queue)  # as pools would: every message goes onto its queue
    jobs = store.create_jobs("b", "synthetic", [{}], n, {}, kw.get("deadline_s"))
    return store, jobs


def _messages(settings) -> StageMessages:
    return StageMessages(create_celery_app(settings))


def counts(r):
    got = counters.read(r, keys.batch_counts("b"), len(ALL_STATES))
    return {k: v for k, v in zip(ALL_STATES, got) if v}


def test_only_one_of_many_concurrent_claims_wins(settings, r):
    store, [job] = make(settings, r)
    wins = []

    def claim(i):
        outcome, _ = store.claim(job.job_id, "init", job.token, f"w{i}")
        wins.append(outcome)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == ["ok"] + ["stale"] * 31
    assert counts(r) == {"init": 1}


def test_a_hand_off_pushes_the_next_message_in_the_same_script(settings, r):
    """With messages, ADVANCE moves the job, pushes the next stage's message (its new
    token as task id) and records it on the queue's index, in one call: no window in which the job
    waits for a message that is not there."""
    store, [job] = make(settings, r)
    r.delete("run.n")
    assert store.claim(job.job_id, "init", job.token, "w", "holder-1")[0] == "ok"
    assert r.hget(f"prorl:job:{job.job_id}", "holder") == "holder-1"
    store.heartbeat([(job.job_id, job.token)], "holder-1")
    token = store.advance(job.job_id, "init", job.token, "run", "run.n", "n", "hstate", "{}",
                          _messages(settings))
    [raw] = r.lrange("run.n", 0, -1)
    message = json.loads(raw)
    assert message_args(message) == [job.job_id, token]
    assert message["headers"]["task"] == "prorl.run" and message["headers"]["id"] == token
    assert message["properties"]["delivery_info"]["routing_key"] == "run.n"
    assert r.zscore("prorl:active", job.job_id) is None  # no heartbeat left to go stale
    assert r.zscore("prorl:queued:run.n", job.job_id) is not None
    assert not r.hget(f"prorl:job:{job.job_id}", "holder")  # the next stage's to set
    r.delete("run.n")


def test_transitions_keep_counts_exact_and_terminal_is_final(settings, r):
    store, [job] = make(settings, r)
    assert store.claim(job.job_id, "run", job.token, "w")[0] == "stale"  # wrong stage
    assert store.claim(job.job_id, "init", "other", "w")[0] == "stale"  # wrong token
    assert store.claim(job.job_id, "init", job.token, "w")[0] == "ok"
    assert store.advance(job.job_id, "init", "other", "run", "run.n", "n", "hstate", "{}") is None
    token = store.advance(job.job_id, "init", job.token, "run", "run.n", "n", "hstate", "{}")
    assert token and counts(r) == {"run": 1}
    # Until the caller's publish is recorded, the worker's heartbeat stands for the job.
    assert r.zscore("prorl:queued:run.n", job.job_id) is None
    assert r.zscore("prorl:active", job.job_id) is not None
    store.handed_off([(job.job_id, token)])
    assert r.zscore("prorl:active", job.job_id) is None
    assert r.zscore("prorl:queued:run.n", job.job_id) is not None
    assert store.claim(job.job_id, "init", job.token, "w")[0] == "stale"  # redelivered INIT
    assert store.finish(job.job_id, JobState.CANCELLED, "cancelled", "x").changed
    assert counts(r) == {"cancelled": 1}
    # Terminal is final: no claim, no second finish, no resurrection.
    assert store.claim(job.job_id, "run", token, "w")[0] == "terminal"
    assert not store.finish(job.job_id, JobState.DONE).changed
    assert store.reap(job.job_id, "active", 1e12, token, "", "x")[0] == "gone"
    assert counts(r) == {"cancelled": 1}
    assert [e[1]["state"] for e in r.xrange("prorl:batch:b:stream")] == ["cancelled"]
    assert r.ttl(f"prorl:job:{job.job_id}") > 0


def test_heartbeat_reports_jobs_to_abort(settings, r):
    store, jobs = make(settings, r, n=3)
    a, b, c = jobs
    for j in jobs:
        store.claim(j.job_id, "init", j.token, "w")
    store.finish(b.job_id, JobState.CANCELLED, "cancelled", "x")
    aborts = store.heartbeat([(a.job_id, a.token), (b.job_id, b.token), (c.job_id, "old")])
    assert sorted(aborts) == sorted([(b.job_id, b.token), (c.job_id, "old")])


def test_reap_requeues_then_fails_worker_lost(settings, r):
    store, [job] = make(settings, r)
    store.claim(job.job_id, "init", job.token, "w")
    future = store.server_time() + 10
    assert store.reap(job.job_id, "active", 0, job.token, "", "x")[0] == "alive"  # fresh beat
    assert store.reap(job.job_id, "active", future, "other", "", "x")[0] == "moved"
    outcome, token = store.reap(job.job_id, "active", future, job.token, "", "worker died")
    assert outcome == "requeue" and counts(r) == {"queued": 1}
    # The same death seen again (a second sweep with what it read before): nothing happens.
    assert store.reap(job.job_id, "active", future, job.token, "", "worker died")[0] == "moved"
    assert store.claim(job.job_id, "init", token, "w")[0] == "ok"
    assert store.reap(job.job_id, "active", future, token, "", "worker died")[0] == "failed"
    raw = store.get_raw(job.job_id)
    assert raw["failure_kind"] == "worker_lost" and raw["requeues"] == "1"
    assert counts(r) == {"failed": 1}


def test_a_requeued_job_starts_a_clean_attempt(settings, r):
    """Nothing of attempt 1 (INIT state, RUN result, node, worker, stage timings) reaches
    attempt 2; only the count and a line of history stay."""
    import json

    store, [job] = make(settings, r)
    store.claim(job.job_id, "init", job.token, "w1")
    run_token = store.advance(job.job_id, "init", job.token, "run", "run.n", "n", "hstate",
                              json.dumps({"sandbox": "attempt-1"}))
    store.handed_off([(job.job_id, run_token)])
    store.claim(job.job_id, "run", run_token, "w1")
    future = store.server_time() + 10
    outcome, token = store.reap(job.job_id, "active", future, run_token, "", "worker died")
    assert outcome == "requeue"
    outcome, claimed = store.claim(job.job_id, "init", token, "w2")
    assert outcome == "ok"
    # The claim hands the stage what it needs, from this attempt only.
    assert "hstate" not in claimed and "result" not in claimed and claimed["requeues"] == "1"
    assert float(claimed["t_init_start"]) > 0 and claimed["handler"] == "synthetic"
    raw = store.get_raw(job.job_id)
    for field in ("hstate", "result", "node", "t_run_queued", "t_run_start", "t_init_end"):
        assert field not in raw, field
    assert raw["worker"] == "w2" and raw["requeues"] == "1"
    [earlier] = json.loads(raw["attempts"])
    assert earlier["attempt"] == 0 and earlier["stage"] == "run" and earlier["node"] == "n"
    assert earlier["reason"] == "worker died"
    from prorl_farm.jobs.model import render_job

    doc = render_job(store.get_raw(job.job_id))
    assert doc["attempts"] == [earlier] and set(doc["timings"]) == {"init"}
    assert doc["timings"]["init"]["queue_wait_s"] >= 0


def test_a_leaving_pool_hands_back_only_jobs_of_its_own_queue(settings, r):
    """A leaving run pool reads which jobs wait on its queue, then their tokens: in between,
    one may have been handed back (by the pool's own delivered-while-leaving path) and gone
    through INIT onto another node. With that token it is still not this pool's: the job
    stays where it is. (A Slurm scancel once moved such a job off the node that took it.)"""
    store, [job] = make(settings, r)
    store.claim(job.job_id, "init", job.token, "w")
    token = store.advance(job.job_id, "init", job.token, "run", "run.a", "a", "hstate", "{}")
    store.handed_off([(job.job_id, token)])
    outcome, token = store.reap(job.job_id, "leave", float("inf"), token, "run.a", "a left")
    assert outcome == "requeue"
    store.claim(job.job_id, "init", token, "w")
    token = store.advance(job.job_id, "init", token, "run", "run.b", "b", "hstate", "{}")
    store.handed_off([(job.job_id, token)])
    assert store.reap(job.job_id, "leave", float("inf"), token, "run.a", "a left")[0] == "moved"
    raw = store.get_raw(job.job_id)
    assert raw["node"] == "b" and raw["token"] == token and raw["phase"] == "waiting"
    # Its own node's pool may still hand it back.
    assert store.reap(job.job_id, "leave", float("inf"), token, "run.b", "b left")[0] == \
        "requeue"


def test_overlapping_sweeps_reap_one_death_once(settings, r):
    """Many reap calls racing on the same dead attempt: one re-queue, no failure."""
    store, jobs = make(settings, r, n=20)
    for j in jobs:
        store.claim(j.job_id, "init", j.token, "w")
    future = store.server_time() + 10
    outcomes = []

    def sweep():
        for j in jobs:
            outcomes.append(store.reap(j.job_id, "active", future, j.token, "", "dead")[0])

    threads = [threading.Thread(target=sweep) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("requeue") == 20 and "failed" not in outcomes
    assert counts(r) == {"queued": 20}


def test_deadline_expiry(settings, r):
    store, [job] = make(settings, r, deadline_s=0.001)
    import time

    time.sleep(0.01)
    assert store.expire_deadlines() == 1
    assert store.get_raw(job.job_id)["failure_kind"] == "timeout"
    assert store.expire_deadlines() == 0


def test_a_running_job_past_its_deadline_gets_the_grace_a_queued_one_does_not(settings, r):
    """A stage running when the deadline passes may stop by itself within the grace (an
    agent loop then keeps its episode so far); a job still queued fails at once."""
    import time

    store, [running, queued] = make(settings, r, n=2, deadline_s=1.0)
    assert store.claim(running.job_id, "init", running.token, "w")[0] == "ok"
    time.sleep(1.1)
    assert store.expire_deadlines(grace_s=3.0) == 1  # the queued one
    assert store.get_raw(queued.job_id)["state"] == "failed"
    assert store.get_raw(running.job_id)["state"] == "init"
    time.sleep(0.5)
    assert store.expire_deadlines(grace_s=0.2) == 1  # past its grace: the backstop
    assert store.get_raw(running.job_id)["failure_kind"] == "timeout"
    assert store.expire_deadlines(grace_s=0.2) == 0


def test_reaper_finds_a_message_lost_in_transit(settings, r):
    """A job whose message vanished (popped by a worker that died before claiming it) is
    re-queued once the sweeps have seen it popped and unclaimed for the stale age."""
    import dataclasses

    from prorl_farm.worker.reaper import Reaper

    store, (lost, newer) = make(settings, r, n=2)
    settings = dataclasses.replace(settings, heartbeat_stale_s=0.5)
    store.settings = settings
    reaper = Reaper(store, settings, _messages(settings))
    before = r.llen("init")
    for job in (lost, newer):
        store.claim(job.job_id, "init", job.token, "w")
        token = store.advance(job.job_id, "init", job.token, "run", "run.n", "n", "hstate", "{}")
        store.handed_off([(job.job_id, token)])
        if job is newer:
            assert store.claim(job.job_id, "run", token, "w")[0] == "ok"
            store.finish(job.job_id, JobState.DONE, token=token)
    import time

    time.sleep(0.6)
    store.pool_beat("run", "n")  # the node's RUN pool is alive: only the message is gone
    assert "requeue" not in reaper.sweep(force=True)  # first seen popped: not yet
    time.sleep(0.6)
    store.pool_beat("run", "n")
    counts = reaper.sweep(force=True)
    raw = store.get_raw(lost.job_id)
    assert counts["requeue"] == 1
    assert raw["state"] == "queued" and "its message was lost" in raw["attempts"]
    # Its new INIT message went with the re-queue, carrying its new token.
    assert r.llen("init") == before + 1
    assert message_args(json.loads(r.lindex("init", 0))) == [lost.job_id, raw["token"]]


def test_messages_published_out_of_order_are_not_taken_for_lost(settings, r):
    """Two submitters: A's job is written first but its message is pushed after B's, and B
    is claimed first. A still waits behind B in the queue: it must not be reaped."""
    import dataclasses
    import time

    from prorl_farm.worker.reaper import Reaper

    settings = dataclasses.replace(settings, heartbeat_stale_s=0.3)
    store = JobStore.from_settings(settings)
    [a] = store.create_jobs("b", "synthetic", [{}], 1, {}, None)
    [b] = store.create_jobs("b", "synthetic", [{}], 1, {}, None)
    store.handed_off([(b.job_id, b.token)])  # B's message pushed and recorded
    assert store.claim(b.job_id, "init", b.token, "w")[0] == "ok"
    store.finish(b.job_id, JobState.DONE, token=b.token)
    store.handed_off([(a.job_id, a.token)])  # A's push completes only now
    reaper = Reaper(store, settings, _messages(settings))
    time.sleep(0.5)
    counts = reaper.sweep(force=True)
    assert "requeue" not in counts and store.get_raw(a.job_id)["token"] == a.token


def test_popped_tells_exactly_the_jobs_whose_message_left_the_queue(settings, r):
    """Queues are FIFO and their index is in push order: of N indexed jobs with L messages
    on the list, the N - L oldest were popped. A claimed job leaves the index; jobs pushed
    in one submission (one push time) are told only once none of them may still wait."""
    store = JobStore.from_settings(settings)
    _STORES.append(store)
    open_slots(r)
    messages = _messages(settings)
    jobs = [store.create_jobs("b", "synthetic", [{}], 1, {}, None, messages=messages)[0]
            for _ in range(4)]
    a, b = store.create_jobs("b", "synthetic", [{}], 2, {}, None, messages=messages)

    def popped():
        rows = store.lua("popped", limit=100, queues=["init"])
        return [rows[i + 1] for i in range(0, len(rows), 3)]

    assert popped() == []
    r.rpop("init", 2)  # the two oldest messages, their worker gone
    assert popped() == [jobs[0].job_id, jobs[1].job_id]
    assert store.claim(jobs[0].job_id, "init", jobs[0].token, "w")[0] == "ok"
    assert popped() == [jobs[1].job_id]
    r.rpop("init", 3)  # the rest of the single submissions, and one of the pair
    assert popped() == [jobs[1].job_id, jobs[2].job_id, jobs[3].job_id]  # not the pair yet
    r.rpop("init")
    assert sorted(popped()[3:]) == sorted([a.job_id, b.job_id])


def test_a_message_pushed_back_by_a_pool_is_indexed_at_its_new_push(settings, r):
    """The pools' transport keeps deliveries in memory: a message rejected with requeue (or
    reserved at a warm shutdown) is pushed back with its job re-indexed at that push, so the
    index stays in push order and the job is never taken for lost."""
    from kombu import Connection, Exchange, Queue

    from prorl_farm.worker.broker import TRANSPORT

    store = JobStore.from_settings(settings)
    _STORES.append(store)
    open_slots(r)
    messages = _messages(settings)
    [first] = store.create_jobs("b", "synthetic", [{}], 1, {}, None, messages=messages)
    [second] = store.create_jobs("b", "synthetic", [{}], 1, {}, None, messages=messages)
    before = r.zscore(keys.queued("init"), first.job_id)
    with Connection(settings.redis_url, transport=TRANSPORT) as conn:
        queue = Queue("init", Exchange("", type="direct"), routing_key="init")
        got = []
        with conn.Consumer(queue, callbacks=[lambda body, m: got.append(m)],
                           accept=["json"]):
            conn.drain_events(timeout=5)
            [message] = got
            assert message.headers["id"] == first.token
            assert r.llen("init") == 1 and not r.exists("unacked")  # no record in Redis
            assert store.lua("popped", limit=10, queues=["init"])[1:3] == [first.job_id,
                                                                           first.token]
            message.requeue()
    assert r.llen("init") == 2
    assert r.zscore(keys.queued("init"), first.job_id) > r.zscore(keys.queued("init"),
                                                                  second.job_id) > before
    assert store.lua("popped", limit=10, queues=["init"]) == []
    # Pushed back as the newest: the second job's message comes off first.
    assert message_args(json.loads(r.rpop("init"))) == [second.job_id, second.token]
    assert message_args(json.loads(r.rpop("init"))) == [first.job_id, first.token]


def test_a_claim_reads_only_the_records_its_store_does_not_hold(settings, r):
    """A prompt's samples share one instance record, a request's jobs one sampling record
    (neither ever changes): a store's first claim reads them, its later claims name them as
    known and Redis sends them no more; a store that never read them gets them from Redis."""
    store, (first, second, third) = make(settings, r, n=3)
    instance_key = keys.instance(r.hget(keys.job(first.job_id), "instance_id"))
    _, raw = store.claim(first.job_id, "init", first.token, "w")
    assert raw["instance"] == "{}" and raw["sampling"] == "{}"
    r.delete(instance_key)  # were a claim to read it now, it would find none
    _, raw = store.claim(second.job_id, "init", second.token, "w")
    assert raw["instance"] == "{}" and raw["sampling"] == "{}"
    fresh = JobStore.from_settings(settings)
    _STORES.append(fresh)
    _, raw = fresh.claim(third.job_id, "init", third.token, "w")
    assert raw["instance"] is None and raw["sampling"] == "{}"
    # A record the store does not hold is read, whatever else it holds.
    other, [job] = make(settings, r)
    r.set(keys.instance(r.hget(keys.job(job.job_id), "instance_id")), '{"x": 1}')
    assert store.claim(job.job_id, "init", job.token, "w")[1]["instance"] == '{"x": 1}'


def test_the_history_takes_each_stage_wait_once_from_its_histogram(settings, r):
    """A claim keeps only its stage's wait histogram; each sample puts the waits claimed
    since the last one into its minute of the dashboard's history, each once (two samplers
    at once included), and counts again from zero if the histogram starts over."""
    from prorl_farm import history

    def waits() -> tuple[float, float]:
        rows = [r.hgetall(k) for k in r.keys(keys.history("*"))]
        return (sum(float(h.get("wait_n:init", 0)) for h in rows),
                sum(float(h.get("wait_sum:init", 0)) for h in rows))

    store, jobs = make(settings, r, n=3)
    for job in jobs:
        assert store.claim(job.job_id, "init", job.token, "w")[0] == "ok"
    assert waits() == (0, 0)  # nothing of the claims themselves
    samplers = [threading.Thread(target=history.record_waits, args=(store,))
                for _ in range(4)]
    for t in samplers:
        t.start()
    for t in samplers:
        t.join()
    n, total = waits()
    assert n == 3 and total >= 0
    assert history.record_waits(store) == 0 and waits()[0] == 3
    r.delete(keys.histogram("wait:init"))  # started over (a flushed metric)
    store2, [late] = make(settings, r)
    assert store2.claim(late.job_id, "init", late.token, "w")[0] == "ok"
    assert history.record_waits(store) == 1 and waits()[0] == 4
