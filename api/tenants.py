"""GET /v1/tenants: each tenant's weight, quotas and usage now (prorl_farm/tenants.py)."""

from __future__ import annotations

from flask import Blueprint, g

from api.services import services
from prorl_farm.tenants import DEFAULT, tenant_rows

bp = Blueprint("tenants", __name__)


@bp.get("/v1/tenants")
def list_tenants():
    svc = services()
    return {"tenants": tenant_rows(svc.store.r, svc.tenants),
            "you": g.get("prorl_tenant", DEFAULT),
            "operator": bool(g.get("prorl_operator", True))}
