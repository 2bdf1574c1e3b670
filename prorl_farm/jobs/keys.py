"""Every Redis key the farm uses, in one place. All start with ``prorl:``."""

PREFIX = "prorl:"


def job(job_id: str) -> str:
    """Hash: one job's fields (see scripts.py for the field names)."""
    return f"{PREFIX}job:{job_id}"


def batch(batch_id: str) -> str:
    """Hash: ``total``, ``created_at``."""
    return f"{PREFIX}batch:{batch_id}"


def batch_counts(batch_id: str) -> str:
    """Hash: state -> number of the batch's jobs in it."""
    return f"{PREFIX}batch:{batch_id}:counts"


def batch_jobs(batch_id: str) -> str:
    """List: the batch's job ids in submission order."""
    return f"{PREFIX}batch:{batch_id}:jobs"


def batch_stream(batch_id: str) -> str:
    """Stream: one entry (``job``, ``state``) per job that reached a terminal state."""
    return f"{PREFIX}batch:{batch_id}:stream"


def queued(queue: str) -> str:
    """Sorted set: job -> time it was put on ``queue`` (removed when claimed or terminal)."""
    return f"{PREFIX}queued:{queue}"


# Hash: queue -> the newest enqueue time of a job claimed from it (for lost-message checks).
CLAIMED = f"{PREFIX}claimed"
# Set: names of every queue a job was ever put on (the reaper walks these).
QUEUES = f"{PREFIX}queues"
# Sorted set: job -> last heartbeat of the worker that holds it (reserved or running).
ACTIVE = f"{PREFIX}active"
# Sorted set: job -> absolute deadline (epoch seconds).
DEADLINES = f"{PREFIX}deadlines"
# Sorted set: "<stage>:<node>" -> last heartbeat of any pool of that stage on that node.
POOLS = f"{PREFIX}pools"
# Hash: terminal state -> number of jobs that ended in it (farm lifetime, for /metrics).
STATS = f"{PREFIX}stats"
# String: held by the pool process that runs the reaper sweep right now.
REAPER_LOCK = f"{PREFIX}reaper:lock"
