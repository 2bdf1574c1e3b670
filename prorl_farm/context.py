"""The JobContext every stage method receives: what a stage knows about its job, and how it
cooperates with cancellation and deadlines. Shared by the stage runner, the handlers and the
LLM session, so it depends on nothing of theirs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prorl_farm.errors import JobAborted, StageTimeout

log = logging.getLogger(__name__)


@dataclass
class JobContext:
    """What a stage knows about its job, and how it cooperates with cancellation.

    ``state`` is what INIT returned (e.g. the sandbox to talk to); ``result`` is what RUN
    returned (e.g. the trajectory), available to EVAL. Long-running handler code calls
    :meth:`check` (or sleeps with :meth:`sleep`) so that cancellation and deadlines stop it
    promptly; the farm fails the job on time even if it does not.
    """

    job_id: str
    batch_id: str
    stage: str
    token: str
    node: str
    instance: dict
    sampling: dict
    instance_index: int = 0
    sample_index: int = 0
    requeues: int = 0  # how many times this job started over (a new attempt, new sandbox)
    # Whether the job had a sandbox started for it before this stage (on any node, in any
    # attempt): its end then looks for sandboxes of it to stop.
    sandboxed: bool = False
    # The CPU group of the job's tenant (sandbox/cgroups.py), which the processes started
    # for it join: its sandboxes, and a grading helper while it grades for it ("": none).
    cpu_group: str = ""
    # The tenant of the job's batch (what a warm grader serves one of: sandbox/warm_graders.py).
    tenant: str = "default"
    # "policy", or "reference": no policy; RUN hands the instance's own reference to EVAL.
    mode: str = "policy"
    state: dict = field(default_factory=dict)
    result: dict | None = None
    # time.monotonic() after which the stage must stop (job deadline or stage time limit).
    deadline_monotonic: float = float("inf")
    abort_event: threading.Event = field(default_factory=threading.Event)
    abort_reason: str = ""
    # The farm's services for handlers: the LLM backend registry, this node's sandboxes
    # (a SandboxManager), the settings.
    backends: Any = None
    sandboxes: Any = None
    settings: Any = None
    _abort_callbacks: list = field(default_factory=list, repr=False)

    @property
    def remaining_s(self) -> float:
        return self.deadline_monotonic - time.monotonic()

    def abort(self, reason: str) -> None:
        """Called from the liveness thread: flag the job and interrupt blocking I/O."""
        self.abort_reason = reason
        self.abort_event.set()
        for callback in list(self._abort_callbacks):
            try:
                callback()
            except Exception:  # an interrupt that fails must not stop the others
                log.warning("abort callback failed", exc_info=True)

    def on_abort(self, callback) -> Callable[[], None]:
        """Run ``callback`` (e.g. close an in-flight request's socket) if the job is aborted;
        returns a function that unregisters it. Runs at once if already aborted."""
        self._abort_callbacks.append(callback)
        if self.abort_event.is_set():
            callback()

        def remove() -> None:
            if callback in self._abort_callbacks:
                self._abort_callbacks.remove(callback)

        return remove

    def check(self) -> None:
        """Raise JobAborted if the job was cancelled or ended elsewhere, StageTimeout if late."""
        if self.abort_event.is_set():
            raise JobAborted(self.abort_reason or "job aborted")
        if time.monotonic() >= self.deadline_monotonic:
            raise StageTimeout(f"{self.stage} stage passed its deadline")

    def sleep(self, seconds: float) -> None:
        """Sleep, waking at once on abort or deadline (then raising like :meth:`check`)."""
        end = time.monotonic() + seconds
        while True:
            self.check()
            now = time.monotonic()
            if now >= end:
                return
            self.abort_event.wait(min(end, self.deadline_monotonic) - now)
