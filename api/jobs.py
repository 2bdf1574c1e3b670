"""POST /v1/jobs, GET /v1/jobs/<id>, POST /v1/jobs/<id>/cancel."""

from __future__ import annotations

import logging

from flask import Blueprint

from api.errors import ApiError, validation_error
from api.schemas import SubmitSchema
from api.services import json_body, services
from prorl_farm.celery_app import TASK_NAMES
from prorl_farm.errors import InvalidInstance, NotFound
from prorl_farm.jobs.cancel import cancel_jobs
from prorl_farm.jobs.model import render_job
from prorl_farm.jobs.store import new_id

log = logging.getLogger(__name__)
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
    errors, normalised = {}, []
    for i, instance in enumerate(instances):
        try:
            normalised.append(handler.validate_instance(instance))
        except InvalidInstance as e:
            errors[i] = e.details or {"_schema": [str(e)]}
    if errors:
        raise validation_error({"instances": errors}, "invalid_instance")
    req["instances"] = normalised
    return req


@bp.post("/v1/jobs")
def submit():
    svc = services()
    req = _validated_submit(json_body())
    batch_id = req["batch_id"] or new_id()
    jobs = svc.store.create_jobs(batch_id, req["handler"], req["instances"], req["n"],
                                 req["sampling"], req["deadline_s"], req["mode"])
    try:
        with svc.celery.producer_or_acquire() as producer:
            for job in jobs:
                svc.celery.send_task(TASK_NAMES["init"], args=[job.job_id, job.token],
                                     queue="init", task_id=job.token, producer=producer)
    except Exception as e:
        # The broker failed mid-way: take back every job of this request, sent or not.
        log.exception("publishing batch %s failed; cancelling its new jobs", batch_id)
        cancel_jobs(svc.store, svc.celery, [j.job_id for j in jobs],
                    "submission failed: broker unavailable")
        raise ApiError(503, "broker_unavailable", f"could not enqueue jobs: {e}") from e
    # Every push has completed: recorded, the reaper can tell a lost message from one that
    # merely waits behind others (see worker/reaper.py).
    svc.store.handed_off([(j.job_id, j.token) for j in jobs])
    return {"batch_id": batch_id, "job_ids": [j.job_id for j in jobs]}, 202


@bp.get("/v1/jobs/<job_id>")
def get_job(job_id: str):
    return render_job(services().store.get_raw(job_id))


@bp.post("/v1/jobs/<job_id>/cancel")
def cancel_job(job_id: str):
    svc = services()
    if svc.store.state_of(job_id) is None:
        raise NotFound(f"job {job_id!r} not found")
    n = cancel_jobs(svc.store, svc.celery, [job_id], "cancelled by request")
    doc = render_job(svc.store.get_raw(job_id))
    return {"cancelled": n, "job": doc}

