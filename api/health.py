"""/healthz (process up), /readyz (Redis and a live pool for every stage), /metrics."""

from __future__ import annotations

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from api.services import services
from prorl_farm.config import STAGES
from prorl_farm.metrics import collect
from prorl_farm.overview import trajectory_store_view

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    return {"ok": True}


@bp.get("/readyz")
def readyz():
    svc = services()
    try:
        svc.store.r.ping()
        pools = svc.store.live_pools(svc.settings.heartbeat_stale_s)
    except Exception as e:
        return {"ready": False, "redis": False, "error": str(e)}, 503
    missing = [s for s in STAGES if not any(p.startswith(f"{s}:") for p in pools)]
    body = {"ready": not missing, "redis": True, "pools": pools, "missing_stages": missing}
    return body, 200 if not missing else 503


@bp.get("/metrics")
def metrics():
    """Prometheus text format: every series of :func:`prorl_farm.metrics.collect`."""
    svc = services()
    registry = CollectorRegistry(auto_describe=False)
    families = collect(svc.store.r, svc.backends.list(),
                       svc.store.live_pools(svc.settings.heartbeat_stale_s),
                       trajectory_store_view(svc.store, svc.payloads), svc.tenants)
    registry.register(_Fixed(families))
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)


class _Fixed:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)
