"""Job states, stage phases and failure kinds (see DESIGN.md, Job lifecycle)."""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    QUEUED = "queued"  # waiting for an INIT worker
    INIT = "init"
    RUN = "run"  # in the RUN stage, waiting on its queue or active
    EVAL = "eval"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATES = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})
ALL_STATES = tuple(s.value for s in JobState)


class FailureKind(str, Enum):
    INVALID_INSTANCE = "invalid_instance"
    INIT_ERROR = "init_error"
    RUN_ERROR = "run_error"
    EVAL_ERROR = "eval_error"
    TIMEOUT = "timeout"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    WORKER_LOST = "worker_lost"
    CANCELLED = "cancelled"


NEXT_STAGE = {"init": "run", "run": "eval", "eval": None}
