"""GET /v1/tenants: each tenant's weight, quotas and usage now (prorl_farm/tenants.py), and
each queue's fair share now (prorl_farm/sharing.py)."""

from __future__ import annotations

from flask import Blueprint, g

from api.services import services
from prorl_farm import sharing as fair
from prorl_farm.tenants import DEFAULT, tenant_rows

bp = Blueprint("tenants", __name__)


@bp.get("/v1/tenants")
def list_tenants():
    svc = services()
    return {"tenants": tenant_rows(svc.store.r, svc.tenants),
            "fair_share": fair.shares(svc.store.r,
                                      {n: t.weight for n, t in svc.tenants.items()}),
            "you": g.get("prorl_tenant", DEFAULT),
            "operator": bool(g.get("prorl_operator", True))}
