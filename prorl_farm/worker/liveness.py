"""Liveness: each worker process heartbeats the jobs it holds, aborts those that ended
elsewhere, enforces stage deadlines, and (in pool main processes) runs the reaper sweep and
the node's sandbox janitor.

One thread per process does it all, with one Redis script call per tick for every job
the process holds, so the cost does not grow with the number of threads in the pool.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable

import redis

from prorl_farm import keys, redisconn
from prorl_farm.config import Settings
from prorl_farm.context import JobContext
from prorl_farm.jobs.store import JobStore
from prorl_farm.states import FailureKind, JobState
from prorl_farm.tenants import parse_tenants
from prorl_farm.worker.reaper import (
    STOP_GRACE_S,
    Reaper,
    heartbeat_refresh_s,
    pool_beat_s,
    slots_renew_s,
)

log = logging.getLogger(__name__)

# Returns the (job, token) pairs of messages this process reserved but may not run yet.
ReservedSource = Callable[[], Iterable[tuple[str, str]]]


# Seconds between runs of a node's sandbox janitor (by one of its pool processes).
JANITOR_EVERY_S = 10.0
# Seconds between re-readings of the offset of Redis's clock from this host's.
CLOCK_EVERY_S = 60.0


class Presence:
    """A worker process's presence: a Redis connection of its own, named after the process.

    The kernel closes a dead process's sockets (kill -9 included), so Redis drops the
    connection at once, and the reaper, which lists Redis's clients, knows within one sweep
    that the process is gone, instead of waiting for its heartbeats to go stale. A live
    process keeps its connection however slow or busy it is (a stalled tick does not make it
    look dead); its pool heartbeat goes over it (reaper.pool_beat_s), which reconnects (and
    renames) it after a drop.
    """

    def __init__(self, settings: Settings, stage: str):
        self.name = (f"{keys.PRESENCE_PREFIX}{stage}:{settings.node}:"
                     f"{socket.gethostname().replace(' ', '_')}:{os.getpid()}:"
                     f"{os.urandom(4).hex()}")
        self.r = redisconn.client(settings.redis_url, client_name=self.name,
                                  single_connection_client=True, socket_timeout=10,
                                  socket_connect_timeout=10)

    def beat(self, pool: str = "", at: float = 0.0) -> None:
        """Heartbeat ``pool`` ("<stage>:<node>") at ``at`` (Redis's clock), or just ping."""
        try:
            if pool:
                self.r.zadd(keys.POOLS, {pool: at})
            else:
                self.r.ping()
        except redis.exceptions.RedisError as e:
            # Heartbeats go on without it; the reaper then judges by their age alone.
            log.warning("presence connection: %s", e)

    def close(self) -> None:
        self.r.close()


def present(r, settle_s: float) -> dict[str, str] | None:
    """The worker processes connected now: {presence name: "<stage>:<node>"}. None where
    that cannot be trusted: a Redis that started, or became the primary (a Sentinel
    failover), less than ``settle_s`` ago may not have seen every live process reconnect yet
    (callers fall back to heartbeat age)."""
    try:
        info = r.info("server", "replication")
        if int(info.get("uptime_in_seconds", 0)) < settle_s:
            return None
        # A replica promoted to primary has been up all along, but its replication id is
        # new: the first sweep that meets an id records when (shared by every reaper).
        replid = info.get("master_replid")
        if replid:
            now = float(r.time()[0])
            pipe = r.pipeline(transaction=False)
            pipe.hsetnx(keys.PRIMARY_SINCE, replid, now)
            pipe.hget(keys.PRIMARY_SINCE, replid)
            pipe.expire(keys.PRIMARY_SINCE, 7 * 24 * 3600)
            since = float(pipe.execute()[1])
            if now - since < settle_s:
                return None
        clients = r.client_list(_type="normal")
    except redis.exceptions.ResponseError as e:  # CLIENT or INFO refused (renamed, ACL)
        log.warning("worker presence unavailable (%s); set PRORL_PRESENCE=0", e)
        return None
    out = {}
    for client in clients:
        name = client.get("name") or ""
        if name.startswith(keys.PRESENCE_PREFIX):
            stage, node = name[len(keys.PRESENCE_PREFIX):].split(":", 2)[:2]
            out[name] = f"{stage}:{node}"
    return out


class Liveness:
    """The per-process heartbeat/abort/deadline thread."""

    def __init__(self, store: JobStore, settings: Settings, stage: str,
                 reserved: ReservedSource | None = None, reaper: Reaper | None = None):
        self.store = store
        self.settings = settings
        self.stage = stage
        self.reserved = reserved
        self.reaper = reaper
        # The node's sandbox janitor (main pool processes): called every JANITOR_EVERY_S,
        # by one process per node at a time.
        self.janitor: Callable[[], int] | None = None
        # The pool's watchdog (main pool processes): told of every turn of the loop, it
        # kills the process if the turns stop while it lives (prorl_farm/watchdog.py).
        self.watchdog = None
        # The slots this pool process takes of its queue, (queue, shared, reserve): set in the
        # main process once its consumer runs, registered each pool beat (lua/fair_fill.lua).
        self.slots: tuple[str, int, int] | None = None
        self._slots_lock = threading.Lock()
        self._left = False
        self._next_beat = self._next_janitor = self._next_clock = self._next_slots = 0.0
        # Full heartbeats (_beat): when the next is due, the jobs beaten since the last, and
        # the K.moved counter as last read.
        self._refresh_s = heartbeat_refresh_s(settings)
        self._next_refresh = 0.0
        self._beaten: set[tuple[str, str]] = set()
        self._moved: str | None = None
        self._clock_offset = 0.0  # Redis's clock less this host's
        self._running: dict[tuple[str, str], JobContext] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.presence = Presence(settings, stage)

    def track(self, ctx: JobContext) -> None:
        with self._lock:
            self._running[(ctx.job_id, ctx.token)] = ctx

    def running_pairs(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._running)

    def untrack(self, ctx: JobContext) -> None:
        with self._lock:
            self._running.pop((ctx.job_id, ctx.token), None)

    def start(self) -> None:
        self.presence.beat()  # present from the start, not from the first tick
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=f"liveness-{self.stage}",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.register_slots(leaving=True)
        except redis.exceptions.RedisError as e:
            log.warning("could not withdraw this pool's slots (they lapse): %s", e)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            if self.watchdog is not None:
                self.watchdog.tick()
            try:
                self.tick()
            except Exception:
                log.warning("liveness tick failed", exc_info=True)

    def tick(self) -> None:
        with self._lock:
            running = dict(self._running)
        reserved = set(self.reserved()) if self.reserved is not None else set()
        for pair in self._beat(set(running) | reserved, reserved):
            ctx = running.get(pair)
            if ctx is not None:
                ctx.abort("job ended or moved on elsewhere")
        # A stage past its deadline gets a grace to stop by itself (an agent loop then keeps
        # the episode so far in the failed job): a tool call cut at the deadline may take
        # seconds to interrupt (IPython gives an interrupt 5 s). Past the grace the job is
        # ended for it.
        grace = max(STOP_GRACE_S, 2 * self.settings.heartbeat_interval_s)
        for ctx in running.values():
            if ctx.remaining_s <= -grace and not ctx.abort_event.is_set():
                self._expire(ctx)
        now = time.monotonic()
        if now >= self._next_clock:
            self._next_clock = now + CLOCK_EVERY_S
            self._clock_offset = self.store.server_time() - time.time()
        if now >= self._next_beat:
            self._next_beat = now + pool_beat_s(self.settings)
            self.presence.beat(f"{self.stage}:{self.settings.node}",
                               time.time() + self._clock_offset)
        if now >= self._next_slots:
            self._next_slots = now + slots_renew_s(self.settings)
            self.register_slots()
        if self.reaper is not None:
            self.reaper.sweep()
        if self.janitor is not None and now >= self._next_janitor:
            self._next_janitor = now + JANITOR_EVERY_S
            lock = keys.janitor_lock(self.settings.node)
            if self.store.try_lock(lock, self.stage, JANITOR_EVERY_S):
                self.janitor()

    def _beat(self, held: set[tuple[str, str]], reserved: set[tuple[str, str]]
              ) -> list[tuple[str, str]]:
        """Heartbeat the jobs this process holds, in one script call: all of them every
        heartbeat_refresh_s, or at once when one was taken from it (its K.moved counter,
        read each tick, changed: lua/lib/jobs.lua signal_holder); between, only the
        ``reserved`` ones (prefetched, not claimed) it has not beaten yet, so that their
        holder is recorded at once (a claim records its own and beats its job). Nothing
        while nothing is held. Returns the pairs to abort."""
        if not held:
            self._beaten = set()
            return []
        now = time.monotonic()
        moved = self.store.r.get(keys.moved(self.presence.name))
        full = now >= self._next_refresh or moved != self._moved
        self._moved = moved
        pairs = held if full else reserved - self._beaten
        if full:
            self._next_refresh = now + self._refresh_s
            self._beaten = set(held)
        else:
            self._beaten = (self._beaten & held) | pairs
        return self.store.heartbeat(pairs, self.presence.name) if pairs else []

    def register_slots(self, leaving: bool = False) -> None:
        """(Re)register this process's slots of its queue, lapsing unless renewed within
        the stale time, and hand free ones to waiting jobs; ``leaving``: withdraw them."""
        # Under a lock: a pool beat's registration that read the slots just before a leave
        # withdrew them would register them again after it (the leave runs in a thread of
        # its own), and the pick would hand them to jobs in the pens of a queue no pool
        # serves any more.
        with self._slots_lock:
            self._left = self._left or leaving  # once left, never registered again
            if self.slots is None or (self._left and not leaving):
                return
            queue, shared, reserve = self.slots
            weights = {name: t.weight
                       for name, t in parse_tenants(self.settings.tenants).items()}
            if leaving:
                self.slots = None
            self.store.fair_fill(queue, self.presence.name, 0 if leaving else shared,
                                 0 if leaving else reserve, self.settings.heartbeat_stale_s,
                                 weights)

    def _expire(self, ctx: JobContext) -> None:
        """A stage that does not stop by itself at its deadline still ends the job, within
        the grace."""
        res = self.store.finish(ctx.job_id, JobState.FAILED, FailureKind.TIMEOUT.value,
                                f"{ctx.stage} stage passed its deadline", token=ctx.token)
        ctx.abort("deadline passed" if res.changed else "job ended elsewhere")
