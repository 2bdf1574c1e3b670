"""The farm's exception tree: one root, subclasses that also inherit the builtin that fits.

Every exception the farm defines derives from FarmError, here or beside the code that raises
it (``api.errors.ApiError``, ``trainer.farm.FarmHTTPError``, ``supervisor.StartupError``...).
The one exception to it: the graders' programs (``graders/*_harness.py`` with ``jail.py``)
run inside sandboxes as standalone scripts that import nothing of the farm, and keep their
own ``JailError``."""

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


class HarnessFailed(FarmError, RuntimeError):
    """An agent harness did not finish its episode: it exited non-zero, was killed, or never
    called the model (failure kind harness_error). ``partial``: what it captured."""

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


class EnvironmentUnreachable(FarmError, ConnectionError):
    """A task's environment server (a Gym resources server) could not be reached: no
    answer at all, as opposed to an answer that is an error (EnvironmentFailed)."""


class EnvironmentFailed(FarmError, RuntimeError):
    """A task's environment server answered a request of the farm's own with an error."""


class ToolRejected(FarmError, RuntimeError):
    """A tool call its tool refused (bad path, ambiguous edit, unknown tool, bad arguments).
    Raised by the tool inside a sandbox, sent back as an error reply (never fatal to the
    tool server), and raised again on the host by ``ToolConnection.call`` with the reply's
    ``kind`` (``tool_error``, ``bad_request``, ``internal``)."""

    def __init__(self, message: str, kind: str = "tool_error"):
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class ProtocolError(FarmError, ConnectionError):
    """A malformed or truncated frame on a tool server's socket."""


class TokenMismatch(FarmError, AssertionError):
    """The token prompt of a turn is not the trajectory's prefix (token-in/token-out)."""
