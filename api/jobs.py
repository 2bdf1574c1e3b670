"""POST /v1/jobs, GET /v1/jobs/<id>, POST /v1/jobs/<id>/cancel."""

from __future__ import annotations

import hashlib
import json
import re
import time
from contextlib import contextmanager

from flask import Blueprint, g, request

from api.errors import ApiError, validation_error
from api.schemas import ID_RE, SubmitSchema
from api.services import json_body, services
from prorl_farm import keys
from prorl_farm.errors import InvalidInstance, NotFound
from prorl_farm.harness import context_refusal, needed_context
from prorl_farm.jobs.cancel import cancel_jobs
from prorl_farm.jobs.model import render_job
from prorl_farm.jobs.store import new_id
from prorl_farm.llm.backends.abstract import explicit_sampling
from prorl_farm.tenants import DEFAULT, Tenant, over_quota, scoped_batch, usage

bp = Blueprint("jobs", __name__)
# What a submit over its tenant's quota is told to wait before it tries again.
RETRY_AFTER_S = 5
# How long a submit waits for its tenant's other submits to be checked and written.
ADMIT_WAIT_S = 20.0


def _check_size(body: dict, limit: int) -> None:
    """Refuse an oversized request before any per-instance work (validation of a million
    instances would cost a minute of API time before its 400)."""
    instances = body.get("instances")
    count = len(instances) if isinstance(instances, list) else 1
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    if count * n > limit:
        field = "instances" if count > limit else "n"
        raise validation_error({field: [f"{count} instances x n={n} = {count * n} jobs; at "
                                        f"most {limit} per request"]}, "too_many_jobs")


def _validated_submit(body: dict) -> dict:
    """Check the whole request before anything is written: nothing half-enqueued."""
    svc = services()
    _check_size(body, svc.settings.max_jobs_per_request)
    req = SubmitSchema().load(body)
    try:
        handler = svc.registry.get(req["handler"])
    except NotFound as e:
        raise validation_error({"handler": [f"{e}; known: {svc.registry.names()}"]},
                               "unknown_handler") from e
    instances = req.pop("instances", None) or [req.pop("instance")]
    errors, short, normalised, served, warned = {}, {}, [], None, {}
    for i, instance in enumerate(instances):
        try:
            normalised.append(handler.validate_instance(instance))
        except InvalidInstance as e:
            errors[i] = e.details or {"_schema": [str(e)]}
            continue
        said = handler.warnings(normalised[-1])
        if said:
            warned[i] = said
        refused = handler.refusals(normalised[-1], svc.settings)
        if refused:
            errors[i] = refused
        elif needed_context(normalised[-1].get("agent")):
            if served is None:
                served = [b.get("max_model_len") for b in svc.backends.list()]
            refused = context_refusal(normalised[-1], req.get("sampling") or {}, served)
            if refused:
                short[i] = refused
    if errors:
        raise validation_error({"instances": errors}, "invalid_instance")
    if short:  # well formed, but the harness cannot run in the context it would get
        raise validation_error({"instances": short}, "insufficient_context")
    req["instances"] = normalised
    req["warnings"] = _warnings(warned)
    return req


def _warnings(warned: dict[int, list[str]]) -> dict:
    """The submit's warnings: ``{"instances": {index: [...]}}``, the same words said once
    for all the instances they apply to (a dataset of one tool's rows says one thing 10,000
    times), at most 100 indexes listed with each."""
    if not warned:
        return {}
    by_words: dict[tuple, list[int]] = {}
    for i, said in warned.items():
        by_words.setdefault(tuple(said), []).append(i)
    return {"instances": [{"indexes": idx[:100], "count": len(idx), "warnings": list(words)}
                          for words, idx in by_words.items()]}


def _replay(record: dict, digest: str) -> tuple[dict, int]:
    if record["digest"] != digest:
        raise ApiError(409, "idempotency_conflict", "this idempotency_key was used for "
                       "another request body", {"idempotency_key": ["used for another "
                                                                     "request body"]})
    if record.get("pending"):
        raise ApiError(503, "submission_in_progress", "the first submit with this "
                       "idempotency_key is still being written; retry")
    return {"batch_id": record["batch_id"], "job_ids": record["job_ids"],
            "replayed": True}, 200


def _tenant(svc, asked: str | None) -> Tenant:
    """The tenant a submit is for: the one it names, if the caller's key may act for it;
    else the key's own. A tenant's key is told the same for a tenant that does not exist
    as for one it may not use: which other tenants exist is not its to learn."""
    me = g.get("prorl_tenant") or DEFAULT
    name = asked or me
    if not g.get("prorl_operator", True) and name != me and \
            name not in svc.tenants[me].may_use:
        yours = sorted({me, *svc.tenants[me].may_use})
        raise ApiError(403, "forbidden", f"this key submits for the tenants {yours} only",
                       {"tenant": [f"one of {yours}"]})
    tenant = svc.tenants.get(name)
    if tenant is None:
        raise validation_error({"tenant": [f"unknown tenant {name!r}"]}, "unknown_tenant")
    return tenant


@contextmanager
def _admitted(svc, tenant: Tenant, adding: int):
    """Hold while a submit of ``adding`` jobs is written, if it fits the tenant's quotas:
    the check and the write of one tenant's submits go one at a time (a lock in Redis), so
    submits side by side cannot pass a quota together. Over a quota: 429 with Retry-After,
    nothing written."""
    if not any(tenant.limits().values()):
        yield
        return
    lock, me = keys.tenant(tenant.name) + ":admit", new_id()
    end = time.monotonic() + ADMIT_WAIT_S
    while not svc.store.try_lock(lock, me, ADMIT_WAIT_S + 40):
        if time.monotonic() > end:
            raise ApiError(503, "busy", f"tenant {tenant.name}'s other submits are still "
                           "being written; retry", headers={"Retry-After": "1"})
        time.sleep(0.005)
    try:
        refused = over_quota(tenant, usage(svc.store.r, [tenant.name])[tenant.name], adding)
        if refused:
            raise ApiError(429, "over_quota", "; ".join(refused["tenant"]), refused,
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        yield
    finally:
        svc.store.lua("release_lock", lock=lock, value=me)


@bp.post("/v1/jobs")
def submit():
    svc = services()
    req = _validated_submit(json_body())
    warnings = req.pop("warnings")
    tenant = _tenant(svc, req.pop("tenant", None))
    key = req.pop("idempotency_key", None) or request.headers.get("Idempotency-Key")
    idempotency = None
    if key:
        if not re.match(ID_RE, key):
            raise validation_error({"idempotency_key": ["1-128 characters from A-Z a-z 0-9 "
                                                        "_ . -"]})
        digest = hashlib.sha256(json.dumps({**req, "tenant": tenant.name},
                                           sort_keys=True).encode()).hexdigest()
        # Each tenant's keys are its own: another's same key neither replays its batch nor
        # says that it exists.
        key = f"{tenant.name}/{key}"
        record = svc.store.reserve_idempotency(key, digest)
        if record is not None:
            return _replay(record, digest)
        idempotency = (key, digest)
    # The batch lives in its tenant's space (tenants.scoped_batch): no other tenant's id
    # can be it, so nothing of another tenant is read, and none can take or probe it.
    batch_id = scoped_batch(tenant.name, req["batch_id"] or new_id())
    try:
        # One transaction: the jobs, their INIT messages and the idempotency record land
        # together or not at all (jobs/messages.py).
        with _admitted(svc, tenant, len(req["instances"]) * req["n"]):
            jobs = svc.store.create_jobs(batch_id, req["handler"], req["instances"], req["n"],
                                         explicit_sampling(req["sampling"]),
                                         req["deadline_s"], req["mode"], idempotency,
                                         svc.messages, tenant=tenant.name,
                                         priority=req["priority"])
    except BaseException:
        if key:
            svc.store.forget_idempotency(key)
        raise
    return {"batch_id": batch_id, "job_ids": [j.job_id for j in jobs],
            **({"warnings": warnings} if warnings else {})}, 202


@bp.get("/v1/jobs/<job_id>")
def get_job(job_id: str):
    svc = services()
    return render_job(svc.store.get_raw(job_id), payloads=svc.payloads)


@bp.post("/v1/jobs/<job_id>/cancel")
def cancel_job(job_id: str):
    svc = services()
    if svc.store.state_of(job_id) is None:
        raise NotFound(f"job {job_id!r} not found")
    n = cancel_jobs(svc.store, svc.celery, [job_id], "cancelled by request")
    doc = render_job(svc.store.get_raw(job_id), payloads=svc.payloads)
    return {"cancelled": n, "job": doc}

