"""Liveness: each worker process heartbeats the jobs it holds, aborts those that ended
elsewhere, enforces stage deadlines, and (in pool main processes) runs the reaper sweep.

One thread per process does it all, with one Redis script call per tick for every job
the process holds, so the cost does not grow with the number of threads in the pool.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable, Iterable

from prorl_farm.config import Settings
from prorl_farm.handlers.base import JobContext
from prorl_farm.jobs import keys
from prorl_farm.jobs.states import FailureKind, JobState
from prorl_farm.jobs.store import JobStore

log = logging.getLogger(__name__)

# Returns the (job, token) pairs of messages this process reserved but may not run yet.
ReservedSource = Callable[[], Iterable[tuple[str, str]]]
# requeue(job_id, token): publish a reaped job to the init queue again.
Requeue = Callable[[str, str], None]


# kombu's Redis transport keeps messages that workers reserved (acks late) in these keys
# until acked; a worker that dies leaves its reserved messages there.
KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"


def _message_args(raw: dict) -> list:
    """The task args of a raw kombu message (Celery protocol 2: body = [args, kwargs, ...])."""
    body = raw.get("body", "")
    if raw.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    decoded = json.loads(body)
    return decoded[0] if isinstance(decoded, list) and decoded else []


def orphaned_messages(r, cutoff: float, limit: int = 100_000) -> list[tuple[str, str]]:
    """(job, token) of farm messages reserved by a worker before ``cutoff`` and never acked.

    A live worker heartbeats every message it holds, so the reap script tells orphans (job
    still waiting for that token, no fresh heartbeat) from messages merely held a long time.
    """
    tags = r.zrangebyscore(KOMBU_UNACKED_INDEX, "-inf", cutoff, start=0, num=limit)
    if not tags:
        return []
    out = []
    for value in r.hmget(KOMBU_UNACKED, tags):
        if value is None:
            continue
        try:
            args = _message_args(json.loads(value)[0])
        except (ValueError, TypeError, KeyError, IndexError):
            continue  # not a message of ours
        if len(args) == 2 and all(isinstance(a, str) for a in args):
            out.append((args[0], args[1]))
    return out


class Reaper:
    """Recovers jobs whose worker died, and fails jobs past their deadline.

    Any pool's process may run a sweep; a short Redis lock lets one do so per interval.
    """

    def __init__(self, store: JobStore, settings: Settings, requeue: Requeue, backends=None):
        self.store = store
        self.settings = settings
        self.requeue = requeue
        self.backends = backends  # a BackendRegistry whose failed backends it probes
        self._prober: threading.Thread | None = None

    def sweep(self, force: bool = False) -> dict[str, int]:
        interval_ms = max(1, int(self.settings.reap_interval_s * 1000))
        if not force and not self.store.r.set(keys.REAPER_LOCK, "1", nx=True, px=interval_ms):
            return {}
        counts = {"timeout": self.store.expire_deadlines()}
        cutoff = self.store.server_time() - self.settings.heartbeat_stale_s
        stale = self.store.r.zrangebyscore(keys.ACTIVE, "-inf", cutoff, start=0, num=1000)
        for job_id in stale:
            self._reap(counts, job_id, "active", cutoff, "", "worker stopped heartbeating")
        live = self.store.live_pools(self.settings.heartbeat_stale_s)
        for queue in self.store.r.smembers(keys.QUEUES):
            if queue == "init":
                continue  # global: any node's INIT pool takes it
            stage, _, node = queue.partition(".")
            if f"{stage}:{node}" in live:
                continue
            waiting = self.store.r.zrangebyscore(keys.queued(queue), "-inf", cutoff,
                                                 start=0, num=1000)
            for job_id in waiting:
                self._reap(counts, job_id, "queued", cutoff, queue,
                           f"no live {stage} pool on node {node}")
        for job_id, token in orphaned_messages(self.store.r, cutoff):
            self._reap(counts, job_id, "orphan", cutoff, token,
                       "its message was taken by a worker that died")
        self._reap_lost(counts, cutoff)
        self._probe_backends()
        if any(counts.values()):
            log.warning("reaper: %s", counts)
        return counts

    def _reap_lost(self, counts: dict, cutoff: float) -> None:
        """Jobs whose message vanished: kombu can drop a message when a worker dies between
        popping it and recording it as unacked. Queues are FIFO, so a job still waiting
        behind a newer job that was already claimed, held by no live worker and absent from
        the unacked messages, has lost its message. As a last resort, nothing waits longer
        than the visibility timeout."""
        r = self.store.r
        claimed = r.hgetall(keys.CLAIMED)
        unacked_tokens: set[str] | None = None
        for queue in r.smembers(keys.QUEUES):
            limit = cutoff - self.settings.visibility_timeout_s
            if queue in claimed:
                limit = max(limit, min(cutoff, float(claimed[queue])))
            ids = r.zrangebyscore(keys.queued(queue), "-inf", f"({limit}", start=0, num=1000)
            if not ids:
                continue
            if unacked_tokens is None:
                unacked_tokens = {token for _, token in orphaned_messages(r, float("inf"))}
            tokens = r.pipeline(transaction=False)
            for job_id in ids:
                tokens.hget(keys.job(job_id), "token")
            for job_id, token in zip(ids, tokens.execute()):
                if token not in unacked_tokens:
                    self._reap(counts, job_id, "queued", cutoff, queue, "its message was lost")

    def _probe_backends(self) -> None:
        """Probe failed backends off the liveness thread, so a slow probe delays nothing."""
        if self.backends is None or (self._prober is not None and self._prober.is_alive()):
            return
        self._prober = threading.Thread(target=self._probe, name="backend-probe", daemon=True)
        self._prober.start()

    def _probe(self) -> None:
        try:
            self.backends.probe_unhealthy()
        except Exception:
            log.warning("backend probe failed", exc_info=True)

    def _reap(self, counts: dict, job_id: str, mode: str, cutoff: float, queue: str,
              why: str) -> None:
        outcome, token = self.store.reap(job_id, mode, cutoff, queue, why)
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome == "requeue":
            self.requeue(job_id, token)
            self.store.handed_off([(job_id, token)])


JANITOR_EVERY = 10


class Liveness:
    """The per-process heartbeat/abort/deadline thread."""

    def __init__(self, store: JobStore, settings: Settings, stage: str,
                 reserved: ReservedSource | None = None, reaper: Reaper | None = None):
        self.store = store
        self.settings = settings
        self.stage = stage
        self.reserved = reserved
        self.reaper = reaper
        # The node's sandbox janitor (main pool processes): called every JANITOR_EVERY ticks,
        # by one process per node at a time.
        self.janitor: Callable[[], int] | None = None
        self._ticks = 0
        self._running: dict[tuple[str, str], JobContext] = {}
        self._handed_off: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def track(self, ctx: JobContext) -> None:
        with self._lock:
            self._running[(ctx.job_id, ctx.token)] = ctx

    def untrack(self, ctx: JobContext) -> None:
        with self._lock:
            self._running.pop((ctx.job_id, ctx.token), None)

    def handed_off(self, job_id: str, new_token: str) -> None:
        """Note a published hand-off; the next tick drops this worker's heartbeat of the job.

        Batched off the hot path: until then the job only carries a fresh heartbeat.
        """
        with self._lock:
            self._handed_off.append((job_id, new_token))

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=f"liveness-{self.stage}",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            try:
                self.tick()
            except Exception:
                log.warning("liveness tick failed", exc_info=True)

    def tick(self) -> None:
        with self._lock:
            running = dict(self._running)
            handed_off, self._handed_off = self._handed_off, []
        self.store.handed_off(handed_off)
        held = set(running)
        if self.reserved is not None:
            held.update(self.reserved())
        for pair in self.store.heartbeat(held):
            ctx = running.get(pair)
            if ctx is not None:
                ctx.abort("job ended or moved on elsewhere")
        for ctx in running.values():
            if ctx.remaining_s <= 0 and not ctx.abort_event.is_set():
                self._expire(ctx)
        self.store.pool_beat(self.stage, self.settings.node)
        if self.reaper is not None:
            self.reaper.sweep()
        self._ticks += 1
        if self.janitor is not None and self._ticks % JANITOR_EVERY == 0:
            lock = f"{keys.PREFIX}janitor:{self.settings.node}"
            ms = int(self.settings.heartbeat_interval_s * JANITOR_EVERY * 1000)
            if self.store.r.set(lock, self.stage, nx=True, px=max(ms, 1)):
                self.janitor()

    def _expire(self, ctx: JobContext) -> None:
        """A stage that does not stop by itself at its deadline still ends the job on time."""
        res = self.store.finish(ctx.job_id, JobState.FAILED, FailureKind.TIMEOUT.value,
                                f"{ctx.stage} stage passed its deadline", token=ctx.token)
        ctx.abort("deadline passed" if res.changed else "job ended elsewhere")
