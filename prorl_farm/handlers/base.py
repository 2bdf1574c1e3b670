"""The AgentHandler ABC and the JobContext each stage method receives."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from marshmallow import Schema
from marshmallow import ValidationError as SchemaError

from prorl_farm.context import JobContext
from prorl_farm.errors import InvalidInstance

__all__ = ["AgentHandler", "JobContext"]


class AgentHandler(ABC):
    """One kind of task: how to start its environment, run the agent, and score it.

    Methods run in different worker pools (and processes), so they share state only through
    the JSON-serialisable dicts they return: INIT's dict becomes ``ctx.state`` for RUN and
    EVAL, RUN's dict becomes ``ctx.result``. Raise :class:`InvalidInstance` for instances
    that cannot be worked on; any other exception fails the job with ``<stage>_error``.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # Whether INIT only makes the job's sandboxes from its instance (so the warm pool may run
    # it ahead of the job, worker/warm.py): its state names the sandbox as ``sandbox``.
    warmable: ClassVar[bool] = False
    # Validates and normalises instances at submit time (marshmallow, unknown fields rejected).
    instance_schema: ClassVar[type[Schema] | None] = None
    # The instance fields the policy may see: RUN (the agent loop) gets only these in
    # ``ctx.instance``; INIT and EVAL get the whole instance. Hidden tests, reference answers
    # and gold patches stay out of RUN this way, whatever the loop puts in a prompt or a
    # sandbox. None: every field is visible (tasks with nothing to hide).
    visible_fields: ClassVar[tuple[str, ...] | None] = None
    # JSON Schema keywords for what the instance schema checks across fields (e.g. "one
    # of these two fields"), so the published schema states every constraint enforced.
    instance_constraints: ClassVar[dict] = {}
    # Published JSON Schemas of instance fields that replace the ones generated from the
    # instance schema (for constraints marshmallow's fields do not state).
    property_schemas: ClassVar[dict] = {}

    def visible_instance(self, instance: dict) -> dict:
        """What RUN may see of ``instance``."""
        if self.visible_fields is None:
            return instance
        return {k: v for k, v in instance.items() if k in self.visible_fields}

    def validate_instance(self, instance: Any) -> dict:
        """Return the normalised instance; raise InvalidInstance with field details."""
        if not isinstance(instance, dict):
            raise InvalidInstance("instance must be a JSON object", {"_schema": ["Not an object."]})
        if self.instance_schema is None:
            return instance
        schema = self.__dict__.get("_schema")
        if schema is None:  # one per handler: loads keep no state on it
            schema = self._schema = self.instance_schema()
        try:
            return schema.load(instance)
        except SchemaError as e:
            raise InvalidInstance("invalid instance", e.normalized_messages()) from e

    def allowed_by(self, settings) -> dict:
        """JSON Schema narrowing of instance fields under these settings (for the OpenAPI
        document), matching :meth:`refusals`: {field: schema}."""
        return {}

    def warnings(self, instance: dict) -> list[str]:
        """What the submit is told of a valid instance it accepted as it is (fields it keeps
        but does not use); [] for none."""
        return []

    def refusals(self, instance: dict, settings) -> dict:
        """Field errors for a valid instance that this farm's settings do not allow (e.g. a
        sandbox with the outside network); {} if it may run."""
        return {}

    @abstractmethod
    def init(self, ctx: JobContext) -> dict | None:
        """Start the job's environment (sandbox, workspace); return state for RUN and EVAL."""

    @abstractmethod
    def run(self, ctx: JobContext) -> dict | None:
        """Drive the agent loop; return the trajectory (becomes the job's result)."""

    @abstractmethod
    def eval(self, ctx: JobContext) -> float | dict:
        """Score the outcome: a reward, or a dict with ``reward`` and more fields to keep."""

    def reference(self, ctx: JobContext) -> dict:
        """RUN in reference mode: the result EVAL grades, built from the instance's own
        reference (its answer, canonical solution or gold patch) instead of a policy."""
        raise InvalidInstance(f"the {self.name} handler has no reference mode")

    def cleanup(self, ctx: JobContext) -> None:  # noqa: B027 - optional hook
        """Release what INIT started, once the job is terminal in this worker. Default: no-op."""

    def on_failure(self, ctx: JobContext, kind: str, message: str) -> None:  # noqa: B027
        """Called when a stage of this handler failed the job. Default: no-op."""


def sandbox_bash(ctx: JobContext, client, command: str, timeout_s: float) -> dict:
    """One command in the job's sandbox shell (a ToolConnection), checked for cancellation and
    deadline first, and given at most ``timeout_s`` and what is left of the deadline."""
    ctx.check()
    timeout = min(timeout_s, max(0.1, ctx.remaining_s))
    return client.call("bash", abort_hook=ctx.on_abort, command=command, timeout_s=timeout)


def run_setup(ctx: JobContext, client, commands: list[str], timeout_s: float) -> None:
    """Run an instance's setup commands in order; the first that fails fails the stage."""
    for command in commands:
        out = sandbox_bash(ctx, client, command, timeout_s)
        if out["exit_code"] != 0:
            raise RuntimeError(f"setup command failed ({out['exit_code']}): {command}\n"
                               f"{out['output'][-2000:]}")
