"""POST /v1/jobs, GET /v1/jobs/<id>, POST /v1/jobs/<id>/cancel."""

from __future__ import annotations

import hashlib
import json
import re

from flask import Blueprint, request

from api.errors import ApiError, validation_error
from api.schemas import ID_RE, SubmitSchema
from api.services import json_body, services
from prorl_farm.errors import InvalidInstance, NotFound
from prorl_farm.gateway.harness import context_refusal, needed_context
from prorl_farm.jobs.cancel import cancel_jobs
from prorl_farm.jobs.model import render_job
from prorl_farm.jobs.store import new_id
from prorl_farm.llm.backends.abstract import explicit_sampling

bp = Blueprint("jobs", __name__)


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
    errors, short, normalised, served = {}, {}, [], None
    for i, instance in enumerate(instances):
        try:
            normalised.append(handler.validate_instance(instance))
        except InvalidInstance as e:
            errors[i] = e.details or {"_schema": [str(e)]}
            continue
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
    return req


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


@bp.post("/v1/jobs")
def submit():
    svc = services()
    req = _validated_submit(json_body())
    key = req.pop("idempotency_key", None) or request.headers.get("Idempotency-Key")
    idempotency = None
    if key:
        if not re.match(ID_RE, key):
            raise validation_error({"idempotency_key": ["1-128 characters from A-Z a-z 0-9 "
                                                        "_ . -"]})
        digest = hashlib.sha256(json.dumps(req, sort_keys=True).encode()).hexdigest()
        record = svc.store.reserve_idempotency(key, digest)
        if record is not None:
            return _replay(record, digest)
        idempotency = (key, digest)
    batch_id = req["batch_id"] or new_id()
    try:
        # One transaction: the jobs, their INIT messages and the idempotency record land
        # together or not at all (jobs/messages.py).
        jobs = svc.store.create_jobs(batch_id, req["handler"], req["instances"], req["n"],
                                     explicit_sampling(req["sampling"]), req["deadline_s"],
                                     req["mode"],
                                     idempotency, svc.messages)
    except BaseException:
        if key:
            svc.store.forget_idempotency(key)
        raise
    return {"batch_id": batch_id, "job_ids": [j.job_id for j in jobs]}, 202


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

