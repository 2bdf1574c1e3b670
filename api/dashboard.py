"""The dashboard: a page for a person at GET / (no build step, refreshes itself), and the
read-only documents it draws from: GET /v1/overview, GET /v1/batches/<id>/stats and
GET /v1/history (the farm a minute at a time over the last day)."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, request

from api.schemas import HistoryQuerySchema, OverviewQuerySchema
from api.services import services
from prorl_farm import history
from prorl_farm.overview import batch_stats, farm_overview

bp = Blueprint("dashboard", __name__)
PAGE = Path(__file__).with_name("dashboard.html")


@bp.get("/")
def page():
    resp = Response(PAGE.read_bytes(), mimetype="text/html")
    # The page shows policy-written text: no inline script but its own, no framing.
    resp.headers["Content-Security-Policy"] = (
        "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; "
        "frame-ancestors 'none'")
    resp.headers["X-Content-Type-Options"] = "nosniff"
    return resp


@bp.get("/v1/overview")
def overview():
    svc = services()
    q = OverviewQuerySchema().load(request.args.to_dict())
    return farm_overview(svc.store, svc.backends.list(), svc.settings, q["batches"],
                         svc.payloads, svc.tenants)


@bp.get("/v1/batches/<batch_id>/stats")
def stats(batch_id: str):
    return batch_stats(services().store, batch_id)


@bp.get("/v1/history")
def farm_history():
    q = HistoryQuerySchema().load(request.args.to_dict())
    return history.series(services().store.r, q["window_s"])
