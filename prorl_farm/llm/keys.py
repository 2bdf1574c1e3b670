"""Redis keys of the backend registry (same ``prorl:`` prefix as the job store)."""

from prorl_farm.jobs.keys import PREFIX


def backend(backend_id: str) -> str:
    """Hash: url, kind, model, tokenizer, capacity, policy_version, drained, healthy, ..."""
    return f"{PREFIX}backend:{backend_id}"


# Set: every registered backend id.
ALL = f"{PREFIX}backends:all"
# Sorted set, the min-heap: backend -> in-flight jobs / capacity; only healthy, undrained ones.
HEAP = f"{PREFIX}backends:heap"
# Hash: backend -> in-flight jobs (every backend, in the heap or not).
INFLIGHT = f"{PREFIX}backends:inflight"
# Hash: job -> the backend it is pinned to (sticky routing; cleared when the job ends).
ASSIGN = f"{PREFIX}backends:assign"
# List: acquire audit records (only with PRORL_BACKEND_AUDIT=1, for tests and debugging).
AUDIT = f"{PREFIX}backends:audit"
