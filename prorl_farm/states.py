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
# Each state's counter in a batch's counts (keys.batch_counts, a counter array: counters.py).
STATE_SLOT = {s: i for i, s in enumerate(ALL_STATES)}


class FailureKind(str, Enum):
    INVALID_INSTANCE = "invalid_instance"
    INIT_ERROR = "init_error"
    RUN_ERROR = "run_error"
    EVAL_ERROR = "eval_error"
    TIMEOUT = "timeout"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    WORKER_LOST = "worker_lost"
    CANCELLED = "cancelled"
    # The trajectory store could not take the payload (disk full, not writable).
    STORAGE_ERROR = "storage_error"
    # An agent harness exited non-zero or never called the model (its output is kept).
    HARNESS_ERROR = "harness_error"


NEXT_STAGE = {"init": "run", "run": "eval", "eval": None}

# The job hash (keys.job): ``id batch_id handler instance_id instance_index sample_index
# sampling_id state stage phase token queue node worker holder requeues attempts created_at
# deadline_at finished_at failure_kind failure_message hstate result reward`` and
# ``t_<stage>_{queued,start,end}``.

# What a stage's claim returns of its job (lua/claim.lua), in this order, then the stage's
# start time.
CLAIM_FIELDS = ("id", "batch_id", "handler", "instance_index", "sample_index", "requeues",
                "mode", "hstate", "result", "deadline_at", "sandboxes")
# Fields that belong to one attempt: a re-queued job starts again without them.
ATTEMPT_FIELDS = ("hstate", "result", "node", "worker", "holder", "reward") + tuple(
    f"t_{stage}_{k}" for stage in NEXT_STAGE for k in ("queued", "start", "end"))
# Earlier attempts' failures kept in a re-queued job's ``attempts`` (the newest).
MAX_ATTEMPT_HISTORY = 5


class Phase(str, Enum):
    """Where a job is within its current stage."""

    WAITING = "waiting"  # its message is on the stage's queue (or held by a worker)
    ACTIVE = "active"  # a worker claimed the stage and runs it
    END = "end"  # terminal


class Claim(str, Enum):
    """Outcome of claiming a stage (the CLAIM script)."""

    OK = "ok"
    MISSING = "missing"  # no such job (expired, never existed)
    TERMINAL = "terminal"  # already done, failed or cancelled
    STALE = "stale"  # a redelivery of a stage that ran or runs, or of an earlier attempt
    EXPIRED = "expired"  # its deadline passed while queued: failed now with timeout


class Reap(str, Enum):
    """Outcome of recovering a job whose worker may be dead (the REAP script)."""

    ALIVE = "alive"  # a fresh heartbeat: a live worker holds it
    GONE = "gone"  # terminal or missing: nothing to do but drop its index entries
    MOVED = "moved"  # it moved on (another token, stage or queue) since it was looked at
    REQUEUE = "requeue"  # started again at INIT: the caller publishes the new message
    FAILED = "failed"  # re-queues used up: failed worker_lost


class StageOutcome(str, Enum):
    """What one stage task did (the Celery task's return value, and its log line)."""

    HANDED_OFF = "handed off"  # the next stage's message is pushed, with the job's move
    DONE = "done"  # EVAL finished the job
    FAILED = "failed"  # the stage failed the job
    ABORTED = "aborted"  # the job ended elsewhere (cancelled, timed out, reaped)
    STALE = "stale"  # the job moved on before this stage could record its outcome
    NOT_RUN = "not run"  # claim refused (redelivery, terminal, expired)

