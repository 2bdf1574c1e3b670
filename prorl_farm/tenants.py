"""Tenants: who a batch belongs to, what each may use, and what each uses now.

One farm serves several trainers and evaluations. Each batch belongs to a *tenant*: by
default the one whose API key submitted it, or the one its ``tenant`` field names where the
key may submit for it. Tenants, their keys, weights and quotas are settings
(``PRORL_TENANTS``: a JSON object, or ``@FILE`` holding one)::

    {"team-a": {"token": "...", "weight": 2, "may_use": ["team-a-eval"],
                "max_queued": 20000, "max_in_flight": 512, "max_sandboxes": 256,
                "max_store_mb": 50000},
     "team-a-eval": {"weight": 1}}

The operator's key (``PRORL_API_TOKEN``) and a farm with no key at all submit as the tenant
``default`` and may name any tenant. A tenant's usage lives in Redis (``keys.tenant``):
its jobs per state, kept by the scripts that move jobs (lua/lib/jobs.lua), its live
sandboxes (lua/sandbox_alloc.lua, sandbox_free.lua), and its bytes in the trajectory store.
Quotas are checked when a batch is submitted: over any of them the submit is refused (429)
and nothing is enqueued.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from prorl_farm import keys
from prorl_farm.errors import ConfigError

DEFAULT = "default"
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
QUOTAS = ("max_queued", "max_in_flight", "max_sandboxes", "max_store_mb")
FIELDS = frozenset({"token", "weight", "may_use", *QUOTAS})


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    token_sha256: str = ""  # the key's digest (the key itself is not kept)
    may_use: frozenset[str] = field(default_factory=frozenset)
    max_queued: int = 0  # jobs waiting for INIT; 0: no limit
    max_in_flight: int = 0  # jobs in INIT, RUN or EVAL
    max_sandboxes: int = 0  # sandboxes live now (on every node)
    max_store_mb: float = 0.0  # trajectory store bytes of its batches not yet removed

    def limits(self) -> dict:
        return {q: getattr(self, q) or None for q in QUOTAS}


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _number(name: str, key: str, value, integer: bool) -> float:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"PRORL_TENANTS: {name}.{key} must be a non-negative "
                          f"{'integer' if integer else 'number'}")
    return value


def parse_tenants(raw: str) -> dict[str, Tenant]:
    """``PRORL_TENANTS`` (JSON, or ``@FILE``) as tenants by name; ``default`` always there.
    A malformed entry raises ConfigError naming it."""
    text = raw.strip()
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as e:
            raise ConfigError(f"PRORL_TENANTS: {e}") from None
    try:
        doc = json.loads(text) if text else {}
    except ValueError as e:
        raise ConfigError(f"PRORL_TENANTS: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError("PRORL_TENANTS: an object {tenant: {token, weight, may_use, "
                          "max_queued, max_in_flight, max_sandboxes, max_store_mb}}")
    out: dict[str, Tenant] = {}
    tokens: set[str] = set()
    for name, spec in doc.items():
        if not NAME.match(name):
            raise ConfigError(f"PRORL_TENANTS: tenant name {name!r} must match {NAME.pattern}")
        if not isinstance(spec, dict) or set(spec) - FIELDS:
            raise ConfigError(f"PRORL_TENANTS: {name} takes {', '.join(sorted(FIELDS))}")
        token = spec.get("token", "")
        if not isinstance(token, str) or (token and len(token) < 16):
            raise ConfigError(f"PRORL_TENANTS: {name}.token must be a string of 16 "
                              "characters or more")
        if token and _digest(token) in tokens:
            raise ConfigError(f"PRORL_TENANTS: {name}.token is another tenant's too")
        may_use = spec.get("may_use", [])
        if not isinstance(may_use, list) or not all(isinstance(m, str) for m in may_use):
            raise ConfigError(f"PRORL_TENANTS: {name}.may_use must be a list of tenants")
        weight = _number(name, "weight", spec.get("weight", 1), False)
        if weight <= 0:
            raise ConfigError(f"PRORL_TENANTS: {name}.weight must be above 0")
        tenant = Tenant(
            name, float(weight), _digest(token) if token else "", frozenset(may_use),
            int(_number(name, "max_queued", spec.get("max_queued", 0), True)),
            int(_number(name, "max_in_flight", spec.get("max_in_flight", 0), True)),
            int(_number(name, "max_sandboxes", spec.get("max_sandboxes", 0), True)),
            float(_number(name, "max_store_mb", spec.get("max_store_mb", 0), False)))
        if token:
            tokens.add(tenant.token_sha256)
        out[name] = tenant
    out.setdefault(DEFAULT, Tenant(DEFAULT))
    for t in out.values():
        unknown = sorted(t.may_use - set(out))
        if unknown:
            raise ConfigError(f"PRORL_TENANTS: {t.name}.may_use names unknown tenants "
                              f"{unknown}")
    return out


# A batch id lives in its tenant's space: the id a farm stores (its keys, its jobs'
# ``batch_id``, what the API answers) is ``<tenant>:<id>``, the default tenant's the bare
# id. A client's id (api/schemas.ID_RE) holds no ``:``, so no tenant's id can be another's:
# A's and B's same client id are two batches, and a batch's tenant is read from its id
# itself, never from a record another write could change.
SCOPE = ":"


def scoped_batch(tenant: str, given: str) -> str:
    """The stored id of the batch ``given`` (a client's id) of ``tenant``."""
    return given if tenant == DEFAULT else f"{tenant}{SCOPE}{given}"


def batch_tenant(batch_id: str) -> str:
    """The tenant of a stored batch id (its space)."""
    tenant, sep, _ = batch_id.partition(SCOPE)
    return tenant if sep else DEFAULT


def resolve_batch(given: str, own: str) -> str:
    """The stored id a caller whose own tenant is ``own`` means by ``given``: a stored id
    as the farm answered it (``<tenant>:<id>``) is itself; a bare id is in the caller's own
    space. (Whether the caller may see that tenant is the caller's check.)"""
    tenant, sep, rest = given.partition(SCOPE)
    return scoped_batch(tenant, rest) if sep else scoped_batch(own, given)


def any_key(api_token: str, tenants: dict[str, Tenant]) -> bool:
    """Whether a farm has keys (the operator's or a tenant's): then every call but the
    probes needs one (api/access.py)."""
    return bool(api_token) or any(t.token_sha256 for t in tenants.values())


def tenant_of_token(tenants: dict[str, Tenant], token: str) -> Tenant | None:
    """The tenant whose key ``token`` is (constant time per tenant), or None."""
    digest = _digest(token).encode()
    found = None
    for t in tenants.values():
        if t.token_sha256 and hmac.compare_digest(t.token_sha256.encode(), digest):
            found = t
    return found


def identify(authorization: str | None, api_token: str, tenants: dict[str, Tenant]
             ) -> tuple[bool, Tenant | None]:
    """Who an ``Authorization`` header says the caller is: (True, None) for the operator's
    key, (False, tenant) for a tenant's, (False, None) for no key the farm knows. (A farm
    without keys is the caller's to read as the operator: :func:`any_key`.)"""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False, None
    given = given.strip()
    if api_token and hmac.compare_digest(given.encode(), api_token.encode()):
        return True, None
    return False, tenant_of_token(tenants, given)


def usage(r, names) -> dict[str, dict]:
    """Each tenant's usage now: jobs per state (queued, in flight: init, run, eval; and
    ended), its live sandboxes and its bytes in the trajectory store."""
    names = list(names)
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.tenant(name))
    out = {}
    for name, raw in zip(names, pipe.execute()):
        counts = {k: max(0, int(v)) for k, v in raw.items()}
        out[name] = {
            "queued": counts.get("queued", 0),
            "in_flight": sum(counts.get(s, 0) for s in ("init", "run", "eval")),
            "done": counts.get("done", 0), "failed": counts.get("failed", 0),
            "cancelled": counts.get("cancelled", 0),
            "sandboxes": counts.get("sandboxes", 0),
            "store_mb": round(counts.get("store_bytes", 0) / 2**20, 3)}
    return out


def over_quota(tenant: Tenant, now: dict, adding: int) -> dict[str, list[str]]:
    """Field errors for a submit of ``adding`` jobs by ``tenant`` at usage ``now``; {} if
    it fits every quota."""
    errors = []
    if tenant.max_queued and now["queued"] + adding > tenant.max_queued:
        errors.append(f"tenant {tenant.name} has {now['queued']} jobs queued; {adding} more "
                      f"would pass its quota of {tenant.max_queued}")
    if tenant.max_in_flight and now["in_flight"] >= tenant.max_in_flight:
        errors.append(f"tenant {tenant.name} has {now['in_flight']} jobs in flight, its "
                      f"quota")
    if tenant.max_sandboxes and now["sandboxes"] >= tenant.max_sandboxes:
        errors.append(f"tenant {tenant.name} has {now['sandboxes']} sandboxes live, its "
                      f"quota")
    if tenant.max_store_mb and now["store_mb"] >= tenant.max_store_mb:
        errors.append(f"tenant {tenant.name} holds {now['store_mb']:.0f} MB in the "
                      f"trajectory store, its quota of {tenant.max_store_mb:g} MB (export "
                      f"and acknowledge batches to free it)")
    return {"tenant": errors} if errors else {}


def tenant_rows(r, configured: dict[str, Tenant]) -> list[dict]:
    """Every tenant (configured, or that ever submitted): weight, quotas, usage now."""
    names = sorted(set(configured) | set(r.smembers(keys.TENANTS)))
    now = usage(r, names)
    out = []
    for name in names:
        t = configured.get(name)
        out.append({"tenant": name, "configured": t is not None,
                    "weight": t.weight if t else None,
                    "quotas": t.limits() if t else None,
                    "may_use": sorted(t.may_use) if t else [],
                    "usage": now[name]})
    return out
