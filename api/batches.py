"""GET /v1/batches, GET /v1/batches/<id>, GET /v1/batches/<id>/results,
POST /v1/batches/results (several batches in one read), POST /v1/batches/<id>/cancel."""

from __future__ import annotations

from flask import Blueprint, request

from api.schemas import BatchListQuerySchema, ManyResultsQuerySchema, ResultsQuerySchema
from api.services import json_body, services
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
    return _page(raws, cursor, svc.store.batch_summary(batch_id))


def _page(raws: list[dict], cursor: str, summary: dict) -> dict:
    """A page of a batch's results as the API answers it."""
    return {"results": [render_job(r, include_instance=False) for r in raws], "cursor": cursor,
            "complete": summary["complete"], "finished": summary["finished"],
            "total": summary["total"]}


@bp.post("/v1/batches/results")
def many_results():
    """Finished jobs of several batches, each after its own cursor; ``wait`` long-polls
    until any incomplete one has a result. A batch not stored comes back ``found: false``."""
    svc = services()
    q = ManyResultsQuerySchema().load(json_body())
    out = {}
    for batch_id, page in svc.store.many_batch_results(q["cursors"], q["limit"],
                                                       q["wait"]).items():
        out[batch_id] = ({"found": True, **_page(page["results"], page["cursor"],
                                                 page["summary"])}
                         if page is not None else {"found": False})
    return {"batches": out}


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel(batch_id: str):
    svc = services()
    summary_before = svc.store.batch_summary(batch_id)  # 404 for an unknown batch
    n = cancel_jobs(svc.store, svc.celery, svc.store.batch_job_ids(batch_id),
                    "batch cancelled by request")
    return {"cancelled": n, "batch": svc.store.batch_summary(batch_id) if n else summary_before}
