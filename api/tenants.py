"""GET /v1/tenants: each tenant's weight, quotas and usage now (prorl_farm/tenants.py), and
each queue's fair share now (prorl_farm/fair_view.py)."""

from __future__ import annotations

from flask import Blueprint, g

from api.access import may_see, sees
from api.services import services
from prorl_farm import fair_view as fair
from prorl_farm.tenants import DEFAULT, tenant_rows

bp = Blueprint("tenants", __name__)


@bp.get("/v1/tenants")
def list_tenants():
    """Every tenant for the operator; a tenant's key sees its own rows (and those of the
    tenants its ``may_use`` names), and each queue's share of them, nothing of the others."""
    svc = services()
    rows = [row for row in tenant_rows(svc.store.r, svc.tenants) if may_see(row["tenant"])]
    shares = fair.shares(svc.store.r, {n: t.weight for n, t in svc.tenants.items()})
    if sees() is not None:  # the queue's slots, and the key's own rows: no figure that
        # counts another tenant's work (the queue's total held, a share of it, a share due
        # among the tenants present)
        shares = [{"queue": q["queue"], "stage": q["stage"], "shared": q["shared"],
                   "reserve": q["reserve"], "tenants": [
                       {k: t[k] for k in ("tenant", "weight", "held", "waiting")}
                       for t in q["tenants"] if may_see(t["tenant"])]}
                  for q in shares]
    return {"tenants": rows, "fair_share": shares,
            "you": g.get("prorl_tenant") or DEFAULT,
            "operator": bool(g.get("prorl_operator", True))}
