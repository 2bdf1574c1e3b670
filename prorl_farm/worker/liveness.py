"""Liveness: each worker process heartbeats the jobs it holds, aborts those that ended
elsewhere, enforces stage deadlines, and (in pool main processes) runs the reaper sweep and
the node's sandbox janitor.

One thread per process does it all, with one Redis script call per tick for every job
the process holds, so the cost does not grow with the number of threads in the pool.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from prorl_farm import keys
from prorl_farm.config import Settings
from prorl_farm.context import JobContext
from prorl_farm.jobs.states import FailureKind, JobState
from prorl_farm.jobs.store import JobStore
from prorl_farm.worker.reaper import Reaper

log = logging.getLogger(__name__)

# Returns the (job, token) pairs of messages this process reserved but may not run yet.
ReservedSource = Callable[[], Iterable[tuple[str, str]]]


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

    def running_pairs(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._running)

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
            lock = keys.janitor_lock(self.settings.node)
            if self.store.try_lock(lock, self.stage,
                                   self.settings.heartbeat_interval_s * JANITOR_EVERY):
                self.janitor()

    def _expire(self, ctx: JobContext) -> None:
        """A stage that does not stop by itself at its deadline still ends the job on time."""
        res = self.store.finish(ctx.job_id, JobState.FAILED, FailureKind.TIMEOUT.value,
                                f"{ctx.stage} stage passed its deadline", token=ctx.token)
        ctx.abort("deadline passed" if res.changed else "job ended elsewhere")
