"""Who may call what: every endpoint's rule, checked before it runs (docs/security.md,
"Tenants are walls").

A caller is the operator (``PRORL_API_TOKEN``), a tenant (its key in ``PRORL_TENANTS``) or
nobody. On a farm with no key at all every caller is the operator (a laptop's farm, bound
to loopback: off loopback `up` makes a key up). With keys, every route but the probes
needs one, and each endpoint has one of these rules:

- ``open``: the probes (``/healthz``, ``/readyz``: they say nothing of tenants) and the
  dashboard's page (it holds no data; it asks for the key its data needs);
- ``key``: any key; what the route answers is the caller's (``GET /v1/batches`` lists
  the batches it may see, the multi-batch read answers ``found: false`` for the others,
  ``/v1/tenants`` shows a tenant its own);
- ``owner``: a route on one batch or job (its summary, results, stats, cancel, ack): the
  key of its tenant, or of a tenant whose ``may_use`` names it, or the operator's. Any
  other key gets the very 404 an unknown id gets, and nothing is done;
- ``backend``: a route on one LLM backend (get, drain, resume, weights, remove): the same
  rule by the backend's tenant. Each tenant has its own backends (a trainer registers
  the servers of its own policy and syncs their weights with its own key), and a tenant's
  jobs are sent to its backends only (lua/lib/backends.lua: a heap per tenant), so no
  tenant's server ever sees another's prompts or chooses its tokens;
- ``operator``: the farm's own surfaces (the dashboard's farm-wide documents,
  ``/metrics``): the operator's key; a tenant's is a 403.

An endpoint without a rule is refused (500): a new route cannot be open by omission, and
``tests/test_walls.py`` tries every route of the OpenAPI document with every kind of key.

A client whose calls keep failing for want of a key or of a visible id (401 and 404) is
answered 429 once it has had ``PRORL_API_DENIALS_PER_MIN`` of them within a minute (per
key; per address for a caller without a known key), so that ids and keys cannot be tried
cheaply, and one tenant's refusals never use up another's limit; ids carry 128 random bits
anyway. A batch id lives in its tenant's space (tenants.scoped_batch): another tenant's id
is refused as a free one is, with one read either way.
"""

from __future__ import annotations

import time

from flask import Flask, g, request

from prorl_farm import keys
from prorl_farm.config import Settings
from prorl_farm.errors import NotFound
from prorl_farm.tenants import (
    DEFAULT,
    Tenant,
    any_key,
    batch_tenant,
    identify,
    resolve_batch,
)

OPEN, KEY, OWNER, BACKEND, OPERATOR = "open", "key", "owner", "backend", "operator"

RULES: dict[str, str] = {
    "health.healthz": OPEN,
    "health.readyz": OPEN,
    "dashboard.page": OPEN,
    "static": OPEN,
    "openapi.openapi": KEY,
    "handlers.list_handlers": KEY,
    "jobs.submit": KEY,
    "batches.recent": KEY,
    "batches.many_results": KEY,
    "tenants.list_tenants": KEY,
    "jobs.get_job": OWNER,
    "jobs.cancel_job": OWNER,
    "batches.summary": OWNER,
    "batches.results": OWNER,
    "batches.cancel": OWNER,
    "batches.ack": OWNER,
    "dashboard.stats": OWNER,
    "dashboard.overview": OPERATOR,
    "dashboard.farm_history": OPERATOR,
    "health.metrics": OPERATOR,
    "backends.register": KEY,
    "backends.list_backends": KEY,
    "backends.sync_all_weights": KEY,
    "backends.get_backend": BACKEND,
    "backends.unregister": BACKEND,
    "backends.drain": BACKEND,
    "backends.resume": BACKEND,
    "backends.sync_weights": BACKEND,
}

DENIAL_WINDOW_S = 60


def sees() -> frozenset[str] | None:
    """The tenants whose batches the caller may see: None for all (the operator)."""
    return g.get("prorl_sees")


def may_see(tenant: str | None) -> bool:
    visible = sees()
    return visible is None or (tenant or DEFAULT) in visible


def own_batch(given: str) -> str | None:
    """The stored id of the batch the caller names ``given`` (a bare id: in its own
    tenant's space; ``<tenant>:<id>``: as the farm answered it), or None where that space is
    not the caller's to see. Nothing is read: a batch's tenant is in its id
    (tenants.scoped_batch), so no other tenant's write can make a batch the caller's, and
    another tenant's id is refused as an unknown one is, before any read."""
    stored = resolve_batch(given, g.get("prorl_tenant") or DEFAULT)
    return stored if may_see(batch_tenant(stored)) else None


def _unauthorized():
    from api.errors import error_response

    resp, status = error_response(401, "unauthorized", "this farm needs "
                                  "'Authorization: Bearer <token>' (PRORL_API_TOKEN, or a "
                                  "tenant's key: PRORL_TENANTS)")
    resp.headers["WWW-Authenticate"] = 'Bearer realm="prorl-farm"'
    return resp, status


def install(app: Flask, settings: Settings, tenants: dict[str, Tenant], store,
            backends) -> None:
    """Check every request against its endpoint's rule (see the module's docstring)."""
    keyed = any_key(settings.api_token, tenants)

    @app.before_request
    def _check():
        _identify(settings, tenants, keyed)
        return _admit(store, backends)

    @app.after_request
    def _count_denials(resp):
        if not keyed or not settings.api_denials_per_min or resp.status_code not in (401, 404):
            return resp
        return _slowed(store, resp, settings.api_denials_per_min)


def _identify(settings: Settings, tenants: dict[str, Tenant], keyed: bool) -> None:
    """Who calls: the operator (``g.prorl_operator``: its token, or a farm with no keys), a
    tenant (``g.prorl_tenant``, and ``g.prorl_sees``: its own and its ``may_use``), or
    nobody the farm knows (tenant None, sees nothing)."""
    g.prorl_tenant, g.prorl_operator, g.prorl_sees = DEFAULT, not keyed, None
    if not keyed:
        return
    operator, tenant = identify(request.headers.get("Authorization"), settings.api_token,
                                tenants)
    if operator:
        g.prorl_operator = True
        return
    if tenant is None:
        g.prorl_tenant = None
        g.prorl_sees = frozenset()
        return
    g.prorl_tenant = tenant.name
    g.prorl_sees = frozenset({tenant.name, *tenant.may_use})


def _admit(store, backends):
    """None if the caller may go on to the route; else the refusal (a response, or an
    ApiError/NotFound raised)."""
    from api.errors import ApiError, error_response

    if request.endpoint is None:  # no such route: Flask's own 404
        return None
    rule = RULES.get(request.endpoint)
    if rule is None:
        return error_response(500, "no_access_rule", f"route {request.endpoint!r} has "
                              "no access rule (api/access.py): refused")
    if rule == OPEN:
        return None
    if g.prorl_tenant is None and not g.prorl_operator:
        return _unauthorized()
    if rule == OPERATOR and not g.prorl_operator:
        raise ApiError(403, "operator_only", "this route is the farm operator's: it "
                       "needs PRORL_API_TOKEN, not a tenant's key")
    # Another tenant's batch, job or backend is answered here exactly as one that does
    # not exist: the same 404, before the route runs (nothing done, nothing told).
    args = request.view_args or {}
    if "batch_id" in args:  # the route gets the stored id, in the caller's space
        args["batch_id"] = _stored_batch(store, args["batch_id"])
    if g.prorl_operator:
        return None
    if rule == BACKEND:
        tenant = backends.tenant_of(args["backend_id"])
        if tenant is None or not may_see(tenant):
            raise NotFound(f"backend {args['backend_id']!r} not found")
    if rule == OWNER and "job_id" in args:
        batch_id = store.r.hget(keys.job(args["job_id"]), "batch_id")
        if batch_id is None or not may_see(batch_tenant(batch_id)):
            raise NotFound(f"job {args['job_id']!r} not found")
    return None


def _stored_batch(store, given: str) -> str:
    """The stored id of the batch ``given`` names for the caller, or the 404 an unknown id
    gets: the same answer, in the same time (one read either way), for another tenant's
    id as for a free one, naming the id as the caller wrote it."""
    stored = own_batch(given)
    found = store.r.exists(keys.batch(stored or resolve_batch(given, DEFAULT)))
    if stored is None or not found:
        raise NotFound(f"batch {given!r} not found")
    return stored


def _slowed(store, resp, limit: int):
    """``resp`` (a 401 or 404), or a 429 once this caller has had more than ``limit`` of
    them within the minute (PRORL_API_DENIALS_PER_MIN): guessing keys and ids is slowed.
    A caller is its key (a tenant's, the operator's) or, without a known key, its address:
    one tenant's denials never spend another's limit."""
    from api.errors import error_response

    window = int(time.time() // DENIAL_WINDOW_S)
    key = f"{keys.PREFIX}denials:{_caller()}:{window}"
    try:
        pipe = store.r.pipeline(transaction=False)
        pipe.incr(key)
        pipe.expire(key, 2 * DENIAL_WINDOW_S)
        n = pipe.execute()[0]
    except Exception:  # noqa: BLE001 - Redis away: the reply stands
        return resp
    if n <= limit:
        return resp
    slow, status = error_response(429, "too_many_denials", f"{n} of your calls were "
                                  f"refused (401/404) within a minute (at most {limit}: "
                                  f"PRORL_API_DENIALS_PER_MIN); try again later")
    slow.status_code = status
    slow.headers["Retry-After"] = str(DENIAL_WINDOW_S - int(time.time()) % DENIAL_WINDOW_S)
    return slow


def _caller() -> str:
    """Whose denials a refusal counts to: ``operator``, ``tenant:<name>``, or
    ``addr:<address>`` for a caller with no key the farm knows."""
    if g.get("prorl_operator"):
        return "operator"
    if g.get("prorl_tenant"):
        return f"tenant:{g.prorl_tenant}"
    return f"addr:{request.remote_addr or '?'}"
