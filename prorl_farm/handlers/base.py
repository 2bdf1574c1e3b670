"""The AgentHandler ABC and the JobContext each stage method receives."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from marshmallow import Schema
from marshmallow import ValidationError as SchemaError

from prorl_farm.errors import InvalidInstance, JobAborted, StageTimeout


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
                logging.getLogger(__name__).warning("abort callback failed", exc_info=True)

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


class AgentHandler(ABC):
    """One kind of task: how to start its environment, run the agent, and score it.

    Methods run in different worker pools (and processes), so they share state only through
    the JSON-serialisable dicts they return: INIT's dict becomes ``ctx.state`` for RUN and
    EVAL, RUN's dict becomes ``ctx.result``. Raise :class:`InvalidInstance` for instances
    that cannot be worked on; any other exception fails the job with ``<stage>_error``.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # Validates and normalises instances at submit time (marshmallow, unknown fields rejected).
    instance_schema: ClassVar[type[Schema] | None] = None

    def validate_instance(self, instance: Any) -> dict:
        """Return the normalised instance; raise InvalidInstance with field details."""
        if not isinstance(instance, dict):
            raise InvalidInstance("instance must be a JSON object", {"_schema": ["Not an object."]})
        if self.instance_schema is None:
            return instance
        try:
            return self.instance_schema().load(instance)
        except SchemaError as e:
            raise InvalidInstance("invalid instance", e.normalized_messages()) from e

    @abstractmethod
    def init(self, ctx: JobContext) -> dict | None:
        """Start the job's environment (sandbox, workspace); return state for RUN and EVAL."""

    @abstractmethod
    def run(self, ctx: JobContext) -> dict | None:
        """Drive the agent loop; return the trajectory (becomes the job's result)."""

    @abstractmethod
    def eval(self, ctx: JobContext) -> float | dict:
        """Score the outcome: a reward, or a dict with ``reward`` and more fields to keep."""

    def cleanup(self, ctx: JobContext) -> None:  # noqa: B027 - optional hook
        """Release what INIT started, once the job is terminal in this worker. Default: no-op."""

    def on_failure(self, ctx: JobContext, kind: str, message: str) -> None:  # noqa: B027
        """Called when a stage of this handler failed the job. Default: no-op."""
