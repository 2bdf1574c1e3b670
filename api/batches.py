"""GET /v1/batches, GET /v1/batches/<id>, GET /v1/batches/<id>/results,
POST /v1/batches/<id>/cancel."""

from __future__ import annotations

from flask import Blueprint, request

from api.schemas import BatchListQuerySchema, ResultsQuerySchema
from api.services import services
from prorl_farm.jobs.cancel import cancel_jobs
from prorl_farm.jobs.model import render_job

bp = Blueprint("batches", __name__)


@bp.get("/v1/batches")
def recent():
    """The newest batches still stored, newest first, with their counts."""
    q = BatchListQuerySchema().load(request.args.to_dict())
    return {"batches": services().store.recent_batches(q["limit"])}


@bp.get("/v1/batches/<batch_id>")
def summary(batch_id: str):
    return services().store.batch_summary(batch_id)


@bp.get("/v1/batches/<batch_id>/results")
def results(batch_id: str):
    """Finished jobs in the order they finished, after ``cursor``; ``wait`` long-polls."""
    svc = services()
    q = ResultsQuerySchema().load(request.args.to_dict())
    raws, cursor = svc.store.batch_results(batch_id, q["cursor"], q["limit"], q["wait"])
    summary = svc.store.batch_summary(batch_id)
    return {"results": [render_job(r, include_instance=False) for r in raws], "cursor": cursor,
            "complete": summary["complete"], "finished": summary["finished"],
            "total": summary["total"]}


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel(batch_id: str):
    svc = services()
    summary_before = svc.store.batch_summary(batch_id)  # 404 for an unknown batch
    n = cancel_jobs(svc.store, svc.celery, svc.store.batch_job_ids(batch_id),
                    "batch cancelled by request")
    return {"cancelled": n, "batch": svc.store.batch_summary(batch_id) if n else summary_before}
