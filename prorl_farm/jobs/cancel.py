"""Cancellation: mark jobs cancelled atomically, then revoke the messages still queued.

A running stage learns of it from its liveness thread within one heartbeat interval and
stops (see liveness.py); a queued message that escapes revoke is a no-op at claim time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from celery import Celery

from prorl_farm.jobs.store import JobStore
from prorl_farm.states import FailureKind, JobState, Phase

log = logging.getLogger(__name__)


def cancel_jobs(store: JobStore, celery: Celery, job_ids: Sequence[str], reason: str) -> int:
    """Cancel every non-terminal job among ``job_ids``; returns how many this call cancelled."""
    revoke: list[str] = []
    cancelled = 0
    for job_id in job_ids:
        res = store.finish(job_id, JobState.CANCELLED, FailureKind.CANCELLED.value, reason)
        if res.changed:
            cancelled += 1
            if res.old_phase == Phase.WAITING.value and res.old_token:
                revoke.append(res.old_token)
    if revoke:
        try:
            celery.control.revoke(revoke)
        except Exception:
            # Not fatal: a revoked-too-late message finds the job cancelled and does nothing.
            log.warning("revoke of %d messages failed", len(revoke), exc_info=True)
    return cancelled
