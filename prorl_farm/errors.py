"""The farm's exception tree: one root, subclasses that also inherit the builtin that fits."""

from __future__ import annotations


class FarmError(Exception):
    """Root of every error the farm raises on purpose."""


class ConfigError(FarmError, ValueError):
    """A PRORL_* setting is missing or malformed."""


class NotFound(FarmError, LookupError):
    """A job, batch or handler that does not exist (or whose record expired)."""


class Conflict(FarmError, ValueError):
    """A request that contradicts the farm's state (e.g. a policy version going back)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class InvalidInstance(FarmError, ValueError):
    """A task instance the handler cannot work with (maps to failure kind invalid_instance)."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


class JobAborted(FarmError):
    """The job went terminal elsewhere (cancelled, timed out, reaped); the stage must stop."""


class StageTimeout(FarmError, TimeoutError):
    """The job's deadline or the stage's time limit has passed. ``partial``: what RUN had
    when it passed (an agent's trajectory so far), kept in the failed job's result."""

    def __init__(self, message: str = "", partial: dict | None = None):
        super().__init__(message)
        self.partial = partial


class BackendUnavailable(FarmError, ConnectionError):
    """No LLM backend could serve the job (maps to failure kind backend_unavailable)."""


class BackendError(FarmError, ConnectionError):
    """An LLM backend failed a request (unreachable, 5xx, timeout): worth a retry elsewhere."""


class BackendRequestError(FarmError, ValueError):
    """An LLM backend rejected the request itself (4xx): retrying elsewhere will not help."""


class StageFailed(FarmError):
    """Raised by a stage task after it recorded its job's failure, so that Celery (and
    Flower) show the task as failed, with the failure kind."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class GradingError(FarmError, RuntimeError):
    """A grader could not give a verdict (its environment failed, it ran out of time, or it
    was stopped): the job fails; a failure is never a zero reward."""


class SandboxError(FarmError, RuntimeError):
    """A sandbox could not be started or reached."""


class ToolCallError(FarmError, RuntimeError):
    """The tool rejected the call (bad path, ambiguous edit, unknown tool...)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class ProtocolError(FarmError, ConnectionError):
    """A malformed or truncated frame on a tool server's socket."""


class ToolError(FarmError):
    """A tool call the tool itself rejects (bad path, ambiguous edit, ...): reported to the
    caller as an error reply, never fatal to the tool server."""


class TokenMismatch(FarmError, AssertionError):
    """The token prompt of a turn is not the trajectory's prefix (token-in/token-out)."""
