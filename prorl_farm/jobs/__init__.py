"""Jobs: states, the Redis job store, batch result streams and liveness (heartbeats, reaper)."""

from prorl_farm.jobs.states import TERMINAL_STATES, FailureKind, JobState

__all__ = ["FailureKind", "JobState", "TERMINAL_STATES"]
