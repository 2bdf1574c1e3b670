"""Log lines of worker processes carry the job (and batch) they are about.

The stage runner sets a context variable for the duration of a stage; a filter on the
process's log handlers copies it into every record as ``%(job)s``, which the worker's log
format prints. Threads of a pool each have their own context, so lines never mix jobs.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

_current: contextvars.ContextVar[str] = contextvars.ContextVar("prorl_job", default="")

FORMAT = "%(asctime)s %(levelname)s %(name)s%(job)s: %(message)s"


@contextlib.contextmanager
def job_log_context(job_id: str, batch_id: str = ""):
    token = _current.set(f" [job {job_id}" + (f" batch {batch_id}]" if batch_id else "]"))
    try:
        yield
    finally:
        _current.reset(token)


class JobFilter(logging.Filter):
    """Adds ``record.job``: `` [job <id> batch <id>]`` inside a stage, else empty."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "job"):
            record.job = _current.get()
        return True


def install(level: str | int = "INFO") -> None:
    """Log to stderr in :data:`FORMAT`, with the job filter on every root handler."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level)
    root.setLevel(level)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(FORMAT))
        if not any(isinstance(f, JobFilter) for f in handler.filters):
            handler.addFilter(JobFilter())
