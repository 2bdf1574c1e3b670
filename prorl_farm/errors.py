"""The farm's exception tree: one root, subclasses that also inherit the builtin that fits."""

from __future__ import annotations


class FarmError(Exception):
    """Root of every error the farm raises on purpose."""


class ConfigError(FarmError, ValueError):
    """A PRORL_* setting is missing or malformed."""


class NotFound(FarmError, LookupError):
    """A job, batch or handler that does not exist (or whose record expired)."""


class InvalidInstance(FarmError, ValueError):
    """A task instance the handler cannot work with (maps to failure kind invalid_instance)."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


class JobAborted(FarmError):
    """The job went terminal elsewhere (cancelled, timed out, reaped); the stage must stop."""


class StageTimeout(FarmError, TimeoutError):
    """The job's deadline or the stage's time limit has passed."""


class BackendUnavailable(FarmError, ConnectionError):
    """No LLM backend could serve the job (maps to failure kind backend_unavailable)."""


class StageError(FarmError, RuntimeError):
    """A handler stage failed; carries the failure kind to record."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class BackendError(FarmError, ConnectionError):
    """An LLM backend failed a request (unreachable, 5xx, timeout): worth a retry elsewhere."""


class BackendRequestError(FarmError, ValueError):
    """An LLM backend rejected the request itself (4xx): retrying elsewhere will not help."""
