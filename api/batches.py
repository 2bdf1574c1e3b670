"""GET /v1/batches, GET /v1/batches/<id>, GET /v1/batches/<id>/results,
POST /v1/batches/results (several batches in one read), POST /v1/batches/<id>/cancel,
POST /v1/batches/<id>/ack.

The results endpoints answer JSON, or with ``Accept: application/vnd.apache.arrow.stream``
the same page as one Arrow table (jobs/payloads.py): the trajectories' arrays as typed
columns, read from the trajectory store without a trip through JSON."""

from __future__ import annotations

import time

from flask import Blueprint, Response, request

from api.access import own_batch, sees
from api.errors import ApiError
from api.schemas import BatchListQuerySchema, ManyResultsQuerySchema, ResultsQuerySchema
from api.services import json_body, services
from prorl_farm.columns import ARROW_STREAM, page_bytes
from prorl_farm.jobs.cancel import cancel_jobs
from prorl_farm.jobs.model import render_job, stored_table

bp = Blueprint("batches", __name__)


@bp.get("/v1/batches")
def recent():
    """The newest batches still stored, newest first, with their counts."""
    q = BatchListQuerySchema().load(request.args.to_dict())
    return {"batches": services().store.recent_batches(q["limit"], sees())}


@bp.get("/v1/batches/<batch_id>")
def summary(batch_id: str):
    return services().store.batch_summary(batch_id)


def _binary() -> bool:
    """Whether the client asked for the Arrow stream (JSON is the default)."""
    return request.accept_mimetypes.best_match(["application/json", ARROW_STREAM]) == \
        ARROW_STREAM


def _meta(cursor: str, summary: dict) -> dict:
    return {"cursor": cursor, "complete": summary["complete"],
            "finished": summary["finished"], "total": summary["total"]}


@bp.get("/v1/batches/<batch_id>/results")
def results(batch_id: str):
    """Finished jobs in the order they finished, after ``cursor``; ``wait`` long-polls."""
    svc = services()
    q = ResultsQuerySchema().load(request.args.to_dict())
    raws, cursor = svc.store.batch_results(batch_id, q["cursor"], q["limit"], q["wait"])
    meta = _meta(cursor, svc.store.batch_summary(batch_id))
    if _binary():
        return _arrow(raws, meta)
    payloads = svc.payloads if q["payload"] else None
    return {"results": [render_job(r, include_instance=False, payloads=payloads)
                        for r in raws], **meta}


def _arrow(raws: list[dict], meta: dict) -> Response:
    """A page as an Arrow stream: each job's document (its result the summary) beside its
    payload's columns as the store holds them."""
    payloads = services().payloads
    docs = [render_job(r, include_instance=False) for r in raws]
    tables = [stored_table(doc["result"], payloads) for doc in docs]
    return Response(page_bytes(docs, tables, meta), mimetype=ARROW_STREAM)


@bp.post("/v1/batches/results")
def many_results():
    """Finished jobs of several batches, each after its own cursor; ``wait`` long-polls
    until any incomplete one has a result. A batch not stored comes back ``found: false``."""
    svc = services()
    q = ManyResultsQuerySchema().load(json_body())
    # Each id in the caller's space; another tenant's is answered as one not stored:
    # found false, never read.
    stored = {b: own_batch(b) for b in q["cursors"]}
    mine = {s: q["cursors"][b] for b, s in stored.items() if s is not None}
    read = svc.store.many_batch_results(mine, q["limit"], q["wait"])
    pages = {b: None if s is None else read.get(s) for b, s in stored.items()}
    metas = {b: ({"found": True, **_meta(p["cursor"], p["summary"])} if p is not None
                 else {"found": False}) for b, p in pages.items()}
    if _binary():
        raws = [r for p in pages.values() if p is not None for r in p["results"]]
        return _arrow(raws, {"batches": metas})
    out = {}
    for batch_id, page in pages.items():
        out[batch_id] = metas[batch_id]
        if page is not None:
            out[batch_id] = {"found": True, "results": [
                render_job(r, include_instance=False, payloads=svc.payloads)
                for r in page["results"]], **metas[batch_id]}
    return {"batches": out}


@bp.post("/v1/batches/<batch_id>/cancel")
def cancel(batch_id: str):
    svc = services()
    summary_before = svc.store.batch_summary(batch_id)  # 404 for an unknown batch
    n = cancel_jobs(svc.store, svc.celery, svc.store.batch_job_ids(batch_id),
                    "batch cancelled by request")
    return {"cancelled": n, "batch": svc.store.batch_summary(batch_id) if n else summary_before}


@bp.post("/v1/batches/<batch_id>/ack")
def ack(batch_id: str):
    """The trainer has consumed the batch: its trajectories' payloads are deleted from the
    store (their summaries stay in Redis until the result TTL). Only a complete batch (cancel
    the rest first): a payload written after its ack would be kept to its TTL."""
    svc = services()
    summary_before = svc.store.batch_summary(batch_id)  # 404 for an unknown batch
    if not summary_before["complete"]:
        left = summary_before["total"] - summary_before["finished"]
        raise ApiError(409, "batch_incomplete", f"batch {batch_id!r} has {left} jobs not "
                       "finished; cancel them first, or ack once it completes",
                       {"batch_id": [f"{left} jobs not finished"]})
    t0 = time.perf_counter()
    files, nbytes = svc.payloads.delete_batch(batch_id)
    svc.store.payloads_gone(batch_id, files, nbytes, acked=True)
    return {"batch_id": batch_id, "acknowledged": True, "payloads_deleted": files,
            "bytes_deleted": nbytes, "seconds": round(time.perf_counter() - t0, 6)}
