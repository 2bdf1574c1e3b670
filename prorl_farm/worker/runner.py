"""The stage runner: the one place a stage is claimed, run, timed, failed or handed on.

Celery's threads pool ignores time limits and revoke(terminate=True), so deadlines and
cancellation of running work are enforced here and by :mod:`prorl_farm.worker.liveness`.
"""

from __future__ import annotations

import json
import logging
import math
import time
import traceback
from dataclasses import dataclass

import redis

from prorl_farm.celery_app import queue_for
from prorl_farm.config import Settings
from prorl_farm.context import JobContext
from prorl_farm.errors import (
    BackendError,
    BackendUnavailable,
    HarnessFailed,
    InvalidInstance,
    JobAborted,
    NotFound,
    StageTimeout,
)
from prorl_farm.handlers.base import AgentHandler
from prorl_farm.handlers.registry import HandlerRegistry
from prorl_farm.jobs.messages import StageMessages
from prorl_farm.jobs.model import with_payload
from prorl_farm.jobs.payloads import (
    PAYLOAD_KEYS,
    StorageError,
    TrajectoryStore,
    has_payload,
    open_store,
    split_payload,
)
from prorl_farm.jobs.store import JobStore
from prorl_farm.sandbox import cgroups
from prorl_farm.states import NEXT_STAGE, Claim, FailureKind, JobState, StageOutcome
from prorl_farm.tenants import batch_tenant, parse_tenants
from prorl_farm.worker.liveness import Liveness
from prorl_farm.worker.logs import job_log_context

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageResult:
    """What one stage task did; ``failure`` is (kind, message) when it failed the job."""

    outcome: StageOutcome
    detail: str = ""
    failure: tuple[str, str] | None = None

    def __str__(self) -> str:
        return f"{self.outcome.value}: {self.detail}" if self.detail else self.outcome.value

# How long a stage that finished its work waits for an unreachable Redis to take its write.
REDIS_OUTAGE_S = 300.0


def build_context(raw: dict, stage: str, token: str, node: str, stage_timeout_s: float
                  ) -> JobContext:
    """The context for a claimed stage; its deadline is the earlier of stage and job limits."""
    started = float(raw[f"t_{stage}_start"])
    limit_s = stage_timeout_s
    if raw.get("deadline_at"):
        limit_s = min(limit_s, float(raw["deadline_at"]) - started)
    return JobContext(
        job_id=raw["id"], batch_id=raw["batch_id"], stage=stage, token=token, node=node,
        instance=json.loads(raw["instance"]) if raw.get("instance") else None,
        sampling=json.loads(raw.get("sampling") or "{}"),
        instance_index=int(raw.get("instance_index", 0)),
        sample_index=int(raw.get("sample_index", 0)),
        requeues=int(raw.get("requeues", 0)),
        sandboxed=bool(raw.get("sandboxes")),
        mode=raw.get("mode") or "policy",
        state=json.loads(raw["hstate"]) if raw.get("hstate") else {},
        result=json.loads(raw["result"]) if raw.get("result") else None,
        deadline_monotonic=time.monotonic() + limit_s,
    )


def _reward_of(output) -> tuple[float, dict]:
    """Split EVAL's output into a finite reward and the extra fields to keep."""
    extra: dict = {}
    if isinstance(output, dict):
        extra = {k: v for k, v in output.items() if k != "reward"}
        output = output.get("reward")
    is_number = isinstance(output, (int, float)) and not isinstance(output, bool)
    if not is_number or not math.isfinite(output):
        raise TypeError(f"eval must return a finite number as reward, got {output!r}")
    return float(output), extra


class StageRunner:
    """Runs one stage of one job, start to finish, inside a worker process."""

    def __init__(self, settings: Settings, store: JobStore, registry: HandlerRegistry,
                 liveness: Liveness, messages: StageMessages, worker_name: str,
                 backends=None, sandboxes=None, payloads: TrajectoryStore | None = None):
        self.settings = settings
        self.payloads = payloads if payloads is not None else open_store(settings)
        self.backends = backends
        self.sandboxes = sandboxes
        self.store = store
        self.registry = registry
        self.liveness = liveness
        self.messages = messages
        self.worker_name = worker_name
        self.warm = None  # the node's warm sandboxes (worker/warm.py), for INIT
        self._weights = {name: t.weight for name, t in parse_tenants(settings.tenants).items()}
        self._cpu_farm = cgroups.farm_cpu_id(settings.redis_url or "", settings.node)

    def __call__(self, stage: str, job_id: str, token: str) -> StageResult:
        with job_log_context(job_id):
            return self._run(stage, job_id, token)

    def _run(self, stage: str, job_id: str, token: str) -> StageResult:
        claim, raw = self.store.claim(job_id, stage, token, self.worker_name,
                                      self.liveness.presence.name)
        if claim is not Claim.OK:
            # A redelivery, a cancelled job's message, or a job past its deadline.
            log.info("%s: not run (%s)", stage, claim.value)
            return StageResult(StageOutcome.NOT_RUN, claim.value)
        with job_log_context(job_id, raw.get("batch_id", "")):
            return self._run_claimed(stage, raw, token)

    def _cpu_group(self, tenant: str) -> str:
        """The CPU group of the tenant, weighted by its share ("" where none)."""
        if not self.settings.tenant_cpu:
            return ""
        return str(cgroups.tenant_cpu(tenant, self._weights.get(tenant, 1.0),
                                      self._cpu_farm) or "")

    def _context(self, stage: str, raw: dict, token: str) -> JobContext:
        ctx = build_context(raw, stage, token, self.settings.node,
                            self.settings.pool(stage).timeout_s)
        ctx.backends, ctx.sandboxes, ctx.settings = self.backends, self.sandboxes, self.settings
        ctx.tenant = batch_tenant(ctx.batch_id)
        ctx.cpu_group = self._cpu_group(ctx.tenant)
        return ctx

    def _output(self, stage: str, handler: AgentHandler, name: str, ctx: JobContext):
        """What the handler's stage makes of the job: RUN in reference mode from the
        instance's own reference; RUN sees only the visible fields; INIT takes a warm
        sandbox where one is ready."""
        if stage == "run" and ctx.mode == "reference":
            return handler.reference(ctx)  # no policy: nothing to hide from
        if stage == "run":
            ctx.instance = handler.visible_instance(ctx.instance)
        output = None
        if stage == "init" and self.warm is not None and handler.warmable and \
                ctx.mode == "policy":
            output = self.warm.take(name, ctx)  # a warm sandbox, or None
        return getattr(handler, stage)(ctx) if output is None else output

    def _run_claimed(self, stage: str, raw: dict, token: str) -> StageResult:
        ctx = self._context(stage, raw, token)
        handler: AgentHandler | None = None
        result = StageResult(StageOutcome.FAILED, "error")
        self.liveness.track(ctx)
        try:
            if stage == "eval":
                ctx.result = self._with_payload(ctx.result)
            if ctx.instance is None:
                raise InvalidInstance("the job's instance is no longer stored (expired)")
            handler = self.registry.get(raw["handler"])
            output = self._output(stage, handler, raw["handler"], ctx)
            ctx.check()
            result = self._through_outage(lambda: self._complete(ctx, output), ctx)
        except JobAborted:
            log.info("%s: aborted (%s)", stage, ctx.abort_reason)
            result = StageResult(StageOutcome.ABORTED, ctx.abort_reason)
        except StageTimeout as e:
            result = self._fail(ctx, handler, FailureKind.TIMEOUT, str(e),
                                partial=e.partial if stage == "run" else None)
        except HarnessFailed as e:
            result = self._fail(ctx, handler, FailureKind.HARNESS_ERROR, str(e),
                                partial=e.partial if stage == "run" else None)
        except (InvalidInstance, NotFound) as e:
            result = self._fail(ctx, handler, FailureKind.INVALID_INSTANCE, str(e))
        except (BackendUnavailable, BackendError) as e:
            result = self._fail(ctx, handler, FailureKind.BACKEND_UNAVAILABLE, str(e))
        except StorageError as e:
            log.warning("%s: %s", stage, e)
            result = self._fail(ctx, handler, FailureKind.STORAGE_ERROR, str(e))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            # The farm's Redis, not the job, failed: nothing is recorded against the job;
            # its attempt goes stale and the reaper starts it again once Redis is back.
            log.warning("%s: Redis unreachable (%s); the job is left to the reaper", stage, e)
            result = StageResult(StageOutcome.ABORTED, f"Redis unreachable: {e}")
        except Exception as e:
            log.warning("%s failed: %s", stage, e, exc_info=True)
            tb = "".join(traceback.format_exception_only(type(e), e)).strip()
            result = self._fail(ctx, handler, FailureKind(f"{stage}_error"), tb)
        finally:
            self.liveness.untrack(ctx)
            if self.sandboxes is not None and self.sandboxes.take_started(ctx.job_id):
                ctx.sandboxed = True
            # Unless the job went on to its next stage, this attempt is over (done, failed,
            # cancelled, or superseded by a requeue): release what it holds.
            if handler is not None and result.outcome is not StageOutcome.HANDED_OFF:
                self._cleanup(handler, ctx)
        return result

    def _complete(self, ctx: JobContext, output) -> StageResult:
        nxt = NEXT_STAGE[ctx.stage]
        if nxt is None:
            reward, extra = _reward_of(output)
            result = dict(ctx.result or {})
            if "payload" in result:  # the arrays stay in the store: Redis keeps the summary
                result = {k: v for k, v in result.items() if k not in PAYLOAD_KEYS}
            if extra:
                result["eval"] = extra
            done = self.store.finish(
                ctx.job_id, JobState.DONE, token=ctx.token,
                fields={"reward": repr(reward), "result": json.dumps(result)},
            )
            return StageResult(StageOutcome.DONE if done.changed else StageOutcome.STALE)
        field = "hstate" if ctx.stage == "init" else "result"
        if field == "result" and has_payload(output):
            output = self._store_payload(ctx, output)
        queue = queue_for(nxt, self.settings.node)
        # One script: the job moves on and the next stage's message is pushed with it.
        new_token = self.store.advance(ctx.job_id, ctx.stage, ctx.token, nxt, queue,
                                       self.settings.node, field, json.dumps(output or {}),
                                       self.messages)
        if new_token is None:
            return StageResult(StageOutcome.STALE)
        return StageResult(StageOutcome.HANDED_OFF, queue)

    def _fail(self, ctx: JobContext, handler: AgentHandler | None, kind: FailureKind,
              message: str, partial: dict | None = None) -> StageResult:
        """Fail the job; ``partial`` (RUN's work so far) is kept as its result."""
        if partial is not None and has_payload(partial):
            try:
                partial = self._store_payload(ctx, partial)
            except StorageError as e:
                log.warning("the partial trajectory is not kept: %s", e)
                partial = split_payload(partial)[0]
        res = self._through_outage(lambda: self.store.finish(
            ctx.job_id, JobState.FAILED, kind.value, message, token=ctx.token,
            fields={"result": json.dumps(partial)} if partial else None), ctx)
        if not res.changed:
            return StageResult(StageOutcome.STALE)
        if handler is not None:
            try:
                handler.on_failure(ctx, kind.value, message)
            except Exception:
                log.exception("on_failure hook of %s failed", handler.name)
        return StageResult(StageOutcome.FAILED, kind.value, (kind.value, message))

    @staticmethod
    def _through_outage(write, ctx: JobContext):
        """A stage's last write (its hand-off, or the job's end), retried while Redis is
        unreachable (a restart, a failover) for up to REDIS_OUTAGE_S: the stage's work is
        done and its write is checked against the attempt's token (a retry of one that
        landed is stale, not a second write), so an outage delays the job and fails
        nothing."""
        waited, pause = 0.0, 0.5
        while True:
            try:
                return write()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                if waited >= REDIS_OUTAGE_S:
                    raise
                log.warning("%s of job %s: Redis unreachable (%s); trying again in %.1f s",
                            ctx.stage, ctx.job_id, e, pause)
                time.sleep(pause)
                waited += pause
                pause = min(5.0, pause * 2)

    def _store_payload(self, ctx: JobContext, output: dict) -> dict:
        """Write a trajectory's payload to the store (durably, before the job moves on);
        returns the summary that Redis keeps, with the payload's ref."""
        summary, payload = split_payload(output)
        ref = self.payloads.put(ctx.batch_id, ctx.job_id, ctx.token, payload)
        self.store.note_payload(ctx.batch_id, ref["bytes"])
        summary["payload"] = ref
        return summary

    def _with_payload(self, result: dict | None) -> dict | None:
        """RUN's result with its payload read back from the store (for EVAL)."""
        result = with_payload(result, self.payloads)
        if (result or {}).get("payload", {}).get("deleted"):
            raise StorageError(f"the trajectory {result['payload']['path']} is not in the "
                               "store (deleted, or another node's store)")
        return result

    def _cleanup(self, handler: AgentHandler, ctx: JobContext) -> None:
        try:
            handler.cleanup(ctx)
        except Exception:
            log.exception("cleanup of %s failed", handler.name)
        # A job no sandbox was started for, before this stage or in it, has none to stop: no
        # look in Redis (every job of a handler without sandboxes).
        if self.sandboxes is not None and ctx.sandboxed:
            try:
                self.sandboxes.stop_for_job(ctx.job_id)
            except Exception:
                log.exception("stopping the job's sandboxes failed")
