"""The reaper: recovers jobs whose worker died or whose message was lost, and fails jobs
past their deadline.

Any pool's main process may run the sweeps: one at a time holds the reaper's lease and
sweeps every reap interval while jobs are under way (an idle farm costs Redis one script
call per interval). Should two sweeps ever overlap (a lease that lapsed under a paused
leader), every recovery is idempotent anyway: lua/reap.lua acts only on the attempt
(token) the sweep looked at, so a job is never reaped twice for one death.

What counts as dead or lost, soundly:
- *active*: a job whose holder stopped heartbeating (every held job, running or merely
  prefetched, is heartbeated by its worker's liveness thread);
- *queued*: a job waiting on the node-local queue of a node none of whose pools of that
  stage heartbeats any more;
- *orphan*: a job whose message sits in kombu's unacked set, reserved by a worker that
  stopped heartbeating it (the worker died). The farm's pools keep no such records
  (worker/broker.py); a plain ``celery worker`` on kombu's own transport does;

A worker process is known dead in two ways. Its heartbeats stop: after ``heartbeat_stale_s``
(30 s by default, long enough that no pause of a live process reaches it). Or, within a
sweep, its presence connection is gone (see ``Presence`` in worker/liveness.py): Redis
drops a dead process's connection the moment the kernel closes it, kill -9 included, while
a live one keeps it however loaded it is. Then its jobs whose heartbeat is older than
``presence_grace_s`` (a few ticks: a live process that lost its connection reconnects in
one) are recovered at once, as are the jobs waiting on the queue of a pool with no process
left. After a Redis restart, until every process has had time to reconnect, only heartbeat
age counts.

- *lost*: a job whose message left its queue but no worker claimed or heartbeats it (its
  worker died between the pop and either; the pools' transport keeps no record of a
  delivery in Redis, worker/broker.py). Queues are FIFO and each queue's index
  (``keys.queued``) holds its waiting jobs by push time, so lua/popped.lua tells the jobs
  whose message has been popped; one the sweeps see popped, unclaimed and without a fresh
  heartbeat for ``heartbeat_stale_s`` is lost. A job whose message its publisher never
  pushed is in no queue's index: the heartbeat that stands for it until the push goes stale
  (*active*).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import redis

from prorl_farm import history, keys
from prorl_farm.config import Settings
from prorl_farm.jobs.messages import StageMessages
from prorl_farm.jobs.store import JobStore
from prorl_farm.states import Reap
from prorl_farm.worker.kombu import reserved_messages, settle

log = logging.getLogger(__name__)

# Seconds between a pool process's heartbeats in keys.POOLS (sent by worker/liveness.py on
# its presence connection, which they also keep connected). A pool none of whose processes
# is connected is dead once its heartbeat is twice this old (or presence_grace_s). Never
# more than a quarter of heartbeat_stale_s: see pool_beat_s.
POOL_BEAT_S = 2.0
# At most this many seconds between a worker's full heartbeats of its jobs (see
# heartbeat_refresh_s): the refresh is what a held job costs Redis every second, and 64 of
# them on each of 1,000 nodes beaten every tick took more than a Redis core
# (bench/control_plane.py).
REFRESH_S = 5.0
# Candidates looked at per kind and sweep.
BATCH = 1000
# After a Redis (re)start, seconds before a missing presence connection counts as a death.
PRESENCE_SETTLE_S = 10.0
# Seconds a stage past its job's deadline has to stop by itself (a tool call cut at the
# deadline may take seconds to interrupt: IPython gives an interrupt 5 s) before its pool
# ends the job; an agent loop that stops keeps the episode so far in the failed job.
STOP_GRACE_S = 6.0
# The reaper's lease lasts this many reap intervals (renewed by every sweep of its holder);
# other processes ask for it every FOLLOW_SWEEPS intervals, so a dead leader's successor
# sweeps within (LEASE_SWEEPS + FOLLOW_SWEEPS) intervals.
LEASE_SWEEPS = 5
FOLLOW_SWEEPS = 10
# Seconds between probes of the failed backends (they run on the leader, even when idle).
PROBE_EVERY_S = 2.0
# Seconds between probes of every backend, the healthy ones too (their server's health
# route, their tokenizer's files): one gone since it was registered leaves the heap before a
# job meets it.
HEALTH_EVERY_S = 10.0
# Seconds between sweeps of the trajectory store (on the leader): the payloads of batches
# whose records expired (unacknowledged at the result TTL) go, and what writers that died
# mid-write left.
PAYLOAD_SWEEP_S = 60.0


def heartbeat_refresh_s(settings) -> float:
    """Seconds between a worker process's full heartbeats of the jobs it holds (between them
    each tick beats only the prefetched jobs it has not beaten yet, and all of them when one
    was taken from it: worker/liveness.py): a sixth of the stale age, at most REFRESH_S,
    never under a tick."""
    return max(settings.heartbeat_interval_s, min(REFRESH_S, settings.heartbeat_stale_s / 6))


def slots_renew_s(settings) -> float:
    """Seconds between a pool process's renewals of the slots it registers on its queue
    (lua/fair_fill.lua; they lapse at the stale age, and a dead process's are withdrawn at
    once by the reaper): a quarter of the stale age, never more often than its pool beat.
    Every node's INIT pools register on the one `init` queue."""
    return max(pool_beat_s(settings), settings.heartbeat_stale_s / 4)


def pool_beat_s(settings) -> float:
    """Seconds between a pool process's heartbeats in keys.POOLS: POOL_BEAT_S, or a quarter
    of the stale age where that is shorter (a pool must beat several times per stale age)."""
    return min(POOL_BEAT_S, settings.heartbeat_stale_s / 4)


def left_reason(stage: str, node: str) -> str:
    """The reason a job handed back by a leaving pool (or for it) gives."""
    return f"node {node} left: its {stage} pool was stopped"


class Reaper:
    def __init__(self, store: JobStore, settings: Settings, messages: StageMessages,
                 backends=None, present: Callable | None = None, payloads=None):
        self.store = store
        self.payloads = payloads  # the trajectory store (jobs/payloads.py) it sweeps
        self.settings = settings
        self.messages = messages  # a re-queued job's INIT message goes with the re-queue
        self.present = present  # worker processes connected now (liveness.present)
        self.backends = backends  # a BackendRegistry whose failed backends it probes
        self._prober: threading.Thread | None = None
        self._me = uuid.uuid4().hex
        self._next = 0.0  # monotonic time of this process's next look
        self._next_probe = 0.0
        self._next_health = 0.0
        self._next_payload_sweep = 0.0
        self._next_history = 0.0
        # (job, token) -> when a sweep of this process first saw its message popped and the
        # job unclaimed (lua/popped.lua); kept only while the next sweep sees it so again.
        self._popped: dict[tuple[str, str], float] = {}

    def sweep(self, force: bool = False) -> dict[str, int]:
        """One sweep, if this process leads the reaping (one process of the farm at a time,
        on a lease it renews with each sweep; the others ask every FOLLOW_SWEEPS intervals
        whether it lapsed) and any job is under way. Returns the outcomes counted by kind
        (empty if this process did not sweep)."""
        now = time.monotonic()
        if not force:
            if now < self._next:
                return {}
            lease_ms = int(LEASE_SWEEPS * self.settings.reap_interval_s * 1000)
            role = self.store.lua("reaper_lead", lease=keys.REAPER_LEASE, me=self._me,
                                  lease_ms=max(1000, lease_ms))
            sweeps = FOLLOW_SWEEPS if role == "follow" else 1
            self._next = now + sweeps * self.settings.reap_interval_s
            if role != "idle" and role != "work":
                return {}
            # A backend that failed is probed back even while nothing runs.
            if now >= self._next_probe:
                self._next_probe = now + PROBE_EVERY_S
                self._probe_backends()
            if now >= self._next_payload_sweep:
                self._next_payload_sweep = now + PAYLOAD_SWEEP_S
                self.sweep_payloads()
            if now >= self._next_history:
                self._next_history = now + history.SAMPLE_S
                try:  # the dashboard's history: stage waits, backend load and latency
                    history.record_waits(self.store)
                    if self.backends is not None:
                        history.record_backends(self.store.r, self.backends.list())
                except Exception:  # noqa: BLE001 - a missed sample is not a fault
                    log.debug("history sample failed", exc_info=True)
            if role == "idle":
                return {}
        counts = self._sweep()
        acted = {k: v for k, v in counts.items()
                 if v and k in ("timeout", Reap.REQUEUE.value, Reap.FAILED.value)}
        if acted:
            log.warning("reaper: %s", counts)
        elif any(counts.values()):
            log.debug("reaper: %s", counts)
        return counts

    def sweep_payloads(self) -> int:
        """Delete the payloads of batches whose records are gone (expired at the result TTL
        without an ack) and stale temporary files; returns the batches deleted."""
        if self.payloads is None:
            return 0
        try:
            ids = sorted(set(self.payloads.batches())
                         | set(self.store.r.zrange(keys.PAYLOAD_BATCHES, 0, -1)))
            pipe = self.store.r.pipeline(transaction=False)
            for batch_id in ids:
                pipe.exists(keys.batch(batch_id))
            gone = [b for b, alive in zip(ids, pipe.execute()) if not alive]
            for batch_id in gone:
                files, nbytes = self.payloads.delete_batch(batch_id)
                self.store.payloads_gone(batch_id, files, nbytes, acked=False)
            self.payloads.sweep_temporary()
        except OSError as e:
            log.warning("trajectory store sweep: %s", e)
            return 0
        if gone:
            log.info("trajectory store: the payloads of %d expired batches deleted", len(gone))
        return len(gone)

    def _sweep(self) -> dict[str, int]:
        store, r = self.store, self.store.r
        # A running job past its deadline is its pool's to end (after STOP_GRACE_S); the
        # sweep ends it only if that pool does not.
        counts = {"timeout": store.expire_deadlines(
            grace_s=STOP_GRACE_S + 2 * self.settings.heartbeat_interval_s)}
        now = store.server_time()
        cutoff = now - self.settings.heartbeat_stale_s
        # Live processes reconnect within a tick or two of a Redis restart (redis-py's
        # retries back off to 2 s at most): until then, absence proves nothing.
        settle_s = min(self.settings.heartbeat_stale_s, PRESENCE_SETTLE_S)
        present = self.present(r, settle_s) if self.present else None
        # With presence known: a heartbeat older than this, from a process that is gone.
        # (A live process's job may be a full refresh old: heartbeat_refresh_s.)
        quick = (now - max(self.settings.presence_grace_s, heartbeat_refresh_s(self.settings)
                           + self.settings.heartbeat_interval_s)
                 if present is not None else cutoff)

        def gone(holder: str | None) -> bool:
            return present is not None and bool(holder) and holder not in present

        self._reap_stale_active(counts, quick, cutoff, gone)
        live = store.live_pools(self.settings.heartbeat_stale_s)
        if present is not None:  # a pool with no process left is dead now, not in 30 s
            fresh = max(self.settings.presence_grace_s, 2 * pool_beat_s(self.settings))
            live = {p: age for p, age in live.items()
                    if age <= fresh or p in present.values()}
        queues = r.smembers(keys.QUEUES)
        if present is not None:
            self._withdraw_gone(queues | {"init"}, present)
        for queue in queues:
            if queue != "init":  # global: any node's INIT pool takes it
                self._reap_dead_node_queue(counts, queue, live, cutoff)
        reserved = reserved_messages(r)
        self._reap_orphans(counts, [m for m in reserved if m.at < quick], cutoff, quick,
                           gone)
        self._reap_lost(counts, queues, {m.token for m in reserved}, cutoff)
        return counts

    def _reap_stale_active(self, counts: dict, quick: float, cutoff: float, gone) -> None:
        """Running or held jobs whose holder is gone (a heartbeat older than ``quick`` from a
        process no longer present) or stopped heartbeating (older than ``cutoff``)."""
        # Oldest heartbeats first: the ones stale by either test come before the rest.
        stale = self.store.r.zrangebyscore(keys.ACTIVE, "-inf", f"({quick}", start=0,
                                           num=BATCH, withscores=True)
        rows = self.store.job_fields([job_id for job_id, _ in stale], "token", "holder")
        for (job_id, beat), (token, holder) in zip(stale, rows):
            if gone(holder):
                self._reap(counts, job_id, "active", quick, token, "",
                           "its worker process is gone")
            elif beat < cutoff:
                self._reap(counts, job_id, "active", cutoff, token, "",
                           "its worker stopped heartbeating")

    def _reap_dead_node_queue(self, counts: dict, queue: str, live: dict,
                              cutoff: float) -> None:
        """The jobs waiting on a node's queue whose pool is not live: handed back where the
        pools left the node, else moved once they waited the stale time."""
        store, r = self.store, self.store.r
        stage, _, node = queue.partition(".")
        if f"{stage}:{node}" in live:
            return
        left = r.hget(keys.LEFT, queue)
        if left is not None:
            until = float(left) + self.settings.heartbeat_stale_s
            self._hand_back_left(counts, queue, until)
            if until < cutoff:  # nothing can arrive in time for the mark any more
                self._forget_left(queue, left)
        # A queued job lost nothing with its pool: it waits the stale time for the pool to
        # come back (a container's restart policy, `up`'s supervisor, take seconds)
        # before a move spends one of its requeues.
        waiting = r.zrangebyscore(keys.queued(queue), "-inf", f"({cutoff}", start=0,
                                  num=BATCH)
        # Jobs in the queue's pens never reached the list: their place is an order, not
        # a time. They go once both the pool's last beat (if it ever beat: a node's run
        # pool may start after its INIT pool has handed it jobs) and their own arrival
        # on the queue are older than the stale time.
        last = r.zscore(keys.POOLS, f"{stage}:{node}")
        if last is None or last < cutoff:
            penned = store.waiting_in_pens(queue, limit=BATCH)
            came = store.job_fields(penned, f"t_{stage}_queued")
            waiting += [job_id for job_id, (at,) in zip(penned, came)
                        if at is None or float(at) < cutoff]
        for job_id, token in zip(waiting, store.tokens(waiting)):
            self._reap(counts, job_id, "queued", cutoff, token, queue,
                       f"no live {stage} pool on node {node}")

    def _hand_back_left(self, counts: dict, queue: str, until: float) -> None:
        """A queue whose pools left their node (lua/leave_sweep.lua's mark) and none came
        back: what waits there arrived while they stopped (a stage that ended on the node as
        its pools left) and goes back to INIT at once, as the leave's own hand-back would,
        without spending a re-queue. What arrives later than ``until`` (a node's INIT pool
        still up without its RUN pool) waits the stale time, as on any dead node's queue."""
        stage, _, node = queue.partition(".")
        waiting = self.store.leave_sweep(queue, mark=False, limit=BATCH)
        came = self.store.job_fields([job_id for job_id, _ in waiting], f"t_{stage}_queued")
        for (job_id, token), (at,) in zip(waiting, came):
            if at is not None and float(at) <= until:
                self._reap(counts, job_id, "leave", float("inf"), token, queue,
                           left_reason(stage, node))

    def _forget_left(self, queue: str, left: str) -> None:
        """Drop the queue's leave mark, unless a newer leave wrote another meanwhile."""
        with self.store.r.pipeline() as pipe:
            try:
                pipe.watch(keys.LEFT)
                if pipe.hget(keys.LEFT, queue) == left:
                    pipe.multi()
                    pipe.hdel(keys.LEFT, queue)
                    pipe.execute()
            except redis.WatchError:
                pass

    def _withdraw_gone(self, queues, present: dict) -> None:
        """The slots registered by pool processes that are gone (killed: they could not
        withdraw them) stop counting now, not when their registration lapses."""
        r = self.store.r
        pipe = r.pipeline(transaction=False)
        queues = sorted(queues)
        for queue in queues:
            pipe.hkeys(keys.slots(queue))
        for queue, pools in zip(queues, pipe.execute()):
            for pool in pools:
                if pool.startswith(keys.PRESENCE_PREFIX) and pool not in present:
                    self.store.fair_fill(queue, pool, 0, 0, 0, {})
                    log.info("the slots of %s on %s withdrawn: its process is gone", pool,
                             queue)

    def _reap_orphans(self, counts: dict, reserved, cutoff: float, quick: float, gone
                      ) -> None:
        """Messages reserved by a worker that stopped heartbeating them (or whose process is
        gone): deal with each job once, then settle the message so that no later sweep
        looks at it again."""
        if not reserved:
            return
        beats = self.store.r.zmscore(keys.ACTIVE, [m.job_id for m in reserved])
        holders = self.store.job_fields([m.job_id for m in reserved], "holder")
        settled = []
        for m, beat, (holder,) in zip(reserved, beats, holders):
            dead_by = quick if gone(holder) else cutoff
            if m.at >= dead_by or (beat is not None and beat >= dead_by):
                continue  # a live worker holds it
            outcome = self._reap(counts, m.job_id, "orphan", dead_by, m.token, "",
                                 "its message was taken by a worker that died")
            if outcome is not Reap.ALIVE:
                settled.append(m.tag)
        settle(self.store.r, settled)

    def _reap_lost(self, counts: dict, queues, unacked_tokens: set[str], cutoff: float
                   ) -> None:
        """Jobs whose message left the queue without being claimed, heartbeated or reserved
        under kombu's own records: lost once the sweeps have seen them so for the stale age
        (a live worker claims a popped message at once, or heartbeats it within a tick)."""
        r = self.store.r
        rows = self.store.lua("popped", limit=BATCH, queues=sorted(queues)) if queues else []
        now = time.monotonic()
        seen, self._popped = self._popped, {}
        triples = [tuple(rows[i:i + 3]) for i in range(0, len(rows), 3)]
        beats = r.zmscore(keys.ACTIVE, [job_id for _, job_id, _ in triples]) if triples else []
        for (queue, job_id, token), beat in zip(triples, beats):
            if token in unacked_tokens or (beat is not None and beat >= cutoff):
                continue
            first = self._popped[(job_id, token)] = seen.get((job_id, token), now)
            if now - first >= self.settings.heartbeat_stale_s:
                self._reap(counts, job_id, "lost", cutoff, token, queue,
                           "its message was lost")

    def _reap(self, counts: dict, job_id: str, mode: str, cutoff: float, token: str | None,
              queue: str, why: str) -> Reap:
        outcome, _ = self.store.reap(job_id, mode, cutoff, token or "", queue, why,
                                     self.messages)
        counts[outcome.value] = counts.get(outcome.value, 0) + 1
        if outcome is Reap.REQUEUE:
            log.warning("job %s re-queued (%s)", job_id, why)
        elif outcome is Reap.FAILED:
            log.warning("job %s failed worker_lost (%s)", job_id, why)
        return outcome

    def _probe_backends(self) -> None:
        """Probe failed backends off the liveness thread, so a slow probe delays nothing."""
        if self.backends is None or (self._prober is not None and self._prober.is_alive()):
            return
        self._prober = threading.Thread(target=self._probe, name="backend-probe", daemon=True)
        self._prober.start()

    def _probe(self) -> None:
        try:
            now = time.monotonic()
            if now >= self._next_health:  # every backend (the first time: at start-up)
                self._next_health = now + HEALTH_EVERY_S
                down, _ = self.backends.probe_all()
                if down:
                    log.warning("backends out of the heap after a probe: %s", down)
            else:
                self.backends.probe_unhealthy()
        except Exception:
            log.warning("backend probe failed", exc_info=True)
