"""LLM backends: register, list, get, unregister, drain, resume."""

from __future__ import annotations

import dataclasses
import logging

from flask import Blueprint, g, request

from api.access import may_see
from api.errors import ApiError, validation_error
from api.schemas import (
    BackendRegisterSchema,
    BackendResumeSchema,
    BackendWeightsSchema,
    RegisterQuerySchema,
)
from api.services import json_body, services
from prorl_farm.access import OWN_PORT, backend_url_refusal, engine_endpoints
from prorl_farm.llm import weights
from prorl_farm.llm.registry import (
    BackendSpec,
    context_length,
    not_an_engine,
    probe,
    tokenizer_error,
)
from prorl_farm.tenants import DEFAULT

bp = Blueprint("backends", __name__)
log = logging.getLogger(__name__)


# What a tenant is told of a URL the farm will not use, whatever the reason (nothing
# listens, something that is no inference server, one of the farm's own ports): the host's
# listeners are not a tenant's to map.
NOT_AN_ENGINE = "no inference server this farm may use answers at this URL"
NO_TOKENIZER = "no tokenizer loads from this path"
# A tenant's URL on the farm's own host, where the operator has not allowed that: said of
# every such URL alike, whatever listens there.
ON_THIS_HOST = ("a tenant's backend on this host (loopback, its own addresses) is refused "
                "unless the operator allows it (PRORL_TENANT_LOOPBACK=1)")


@bp.post("/v1/backends")
def register():
    """Check that its tokenizer loads here as the pools load it (400 ``invalid_tokenizer``,
    the path named, if not), probe the backend's health route, then register it: healthy
    and in the heap if it answered, else ``healthy: false`` with the error (it joins the
    heap once a later probe succeeds). With ``?probe=strict`` an unhealthy backend is
    refused (422, nothing stored). A tenant's key registers only a URL that answers as an
    inference server now (422 with one message for every other case), and only an engine
    no other tenant's backend reaches (409); nothing is sent that changes the engine (its
    weights' version label) until the registration is accepted."""
    query = RegisterQuerySchema().load(request.args.to_dict())
    body = BackendRegisterSchema().load(json_body())
    svc = services()
    spec = BackendSpec(**{**body, "tenant": _owner(svc, body.pop("tenant", None))})
    operator = bool(g.get("prorl_operator", True))
    if not operator and not svc.settings.tenant_loopback and any(
            e.startswith("local:") for e in engine_endpoints(spec.url)):
        raise ApiError(403, "backend_not_allowed", f"url: {ON_THIS_HOST}",
                       {"url": [ON_THIS_HOST]})
    refusal = backend_url_refusal(spec.url, svc.allow_list, svc.settings.farm_listeners())
    if refusal == OWN_PORT and not operator:
        raise ApiError(422, "not_an_engine", f"url: {NOT_AN_ENGINE}", {"url": [NOT_AN_ENGINE]})
    if refusal:
        raise ApiError(403, "backend_not_allowed", f"url: {refusal}", {"url": [refusal]})
    why = tokenizer_error(spec.tokenizer)
    if why:  # every job pinned to it would fail: refused, nothing stored
        why = why if operator else NO_TOKENIZER
        raise ApiError(400, "invalid_tokenizer", f"tokenizer: {why}", {"tokenizer": [why]})
    error = probe(spec.url) if operator else not_an_engine(spec.url)
    if error and not operator:
        raise ApiError(422, "not_an_engine", f"url: {NOT_AN_ENGINE}", {"url": [NOT_AN_ENGINE]})
    if error and query["probe"] == "strict":
        raise ApiError(422, "backend_unhealthy", f"url: {error}", {"url": [error]})
    return _stored_and_labelled(svc, spec, error), 201


def _stored_and_labelled(svc, spec: BackendSpec, error: str | None) -> dict:
    """Register ``spec`` (the registry claims its engine for its tenant: 409
    ``engine_taken`` where another tenant's backend reaches it, nothing stored or sent),
    then label the engine's weights."""
    if not spec.max_model_len and not error:
        spec = dataclasses.replace(spec, max_model_len=context_length(spec.url, spec.model)
                                   or 0)
    backend_id = svc.backends.register(spec, probe_error=error)
    if not error:
        _label(spec.kind, spec.url, spec.policy_version)
    return svc.backends.get(backend_id)


def _owner(svc, asked: str | None) -> str:
    """The tenant a registration is for: the key's own, or the one it names where the key
    may act for it (the operator's: any configured tenant). A tenant's key is told the same
    of a tenant that does not exist as of one it may not use."""
    me = g.get("prorl_tenant") or DEFAULT
    name = asked or me
    if not may_see(name):
        raise ApiError(403, "forbidden", f"this key registers backends for tenant {me!r} "
                       "and those it may use only", {"tenant": [f"not {me!r}'s to use"]})
    if name not in svc.tenants:
        raise validation_error({"tenant": [f"unknown tenant {name!r}"]}, "unknown_tenant")
    return name


def _label(kind: str, url: str, version: int) -> None:
    """Label the engine's weights with the version they are registered at, where the
    engine labels the tokens it samples (a label left by an earlier farm or run would
    otherwise name them)."""
    try:
        weights.label_version(kind, url, version)
    except weights.WeightSyncError as e:
        log.warning("backend %s: its weights' version label was not set: %s", url, e)


@bp.get("/v1/backends")
def list_backends():
    """The backends the key may see: its tenant's (and those its ``may_use`` names); the
    operator's, every one."""
    return {"backends": [b for b in services().backends.list() if may_see(b["tenant"])]}


@bp.get("/v1/backends/<backend_id>")
def get_backend(backend_id: str):
    return services().backends.get(backend_id)


@bp.delete("/v1/backends/<backend_id>")
def unregister(backend_id: str):
    services().backends.unregister(backend_id)
    return {"id": backend_id, "unregistered": True}


@bp.post("/v1/backends/<backend_id>/drain")
def drain(backend_id: str):
    return services().backends.drain(backend_id)


@bp.post("/v1/backends/<backend_id>/resume")
def resume(backend_id: str):
    body = BackendResumeSchema().load(json_body())
    out = services().backends.resume(backend_id, body["policy_version"])
    _label(out["kind"], out["url"], body["policy_version"])
    return out


def _probe(body: dict) -> weights.Probe | None:
    probe = body.get("probe")
    if probe is None:
        return None
    if len(probe["logprobs"]) != len(probe["token_ids"]) - 1:
        why = (f"one per token after the first: {len(probe['token_ids']) - 1} for "
               f"{len(probe['token_ids'])} token ids, not {len(probe['logprobs'])}")
        raise ApiError(422, "invalid_probe", f"probe.logprobs: {why}",
                       {"probe": {"logprobs": [why]}})
    return weights.Probe(probe["token_ids"], probe["logprobs"])


def _sync(backend_id: str, body: dict, probe: weights.Probe | None) -> dict:
    svc = services()
    try:
        return weights.sync(svc.backends, backend_id, body["path"], body["policy_version"],
                            probe=probe,
                            tolerance=body.get("tolerance") or svc.settings.weights_tolerance,
                            drain_timeout_s=body["drain_timeout_s"], verify=body["verify"],
                            mode=body["mode"])
    except weights.WeightSyncError as e:
        raise ApiError(422, "weight_sync_failed", str(e)) from e


@bp.post("/v1/backends/<backend_id>/weights")
def sync_weights(backend_id: str):
    """Load new weights into one backend the engine's way and resume it at the new policy
    version once a check shows it computes what the checkpoint computes: drain, wait for
    in-flight 0, load, reset its prefix cache, verify, resume. A failed check keeps the
    backend out of the heap (``weights.error``) and answers 409 ``weights_mismatch``."""
    body = BackendWeightsSchema().load(json_body())
    out = _sync(backend_id, body, _probe(body))
    if out["weights"]["error"]:
        raise ApiError(409, "weights_mismatch", out["weights"]["error"], {"backend": out})
    return out


@bp.post("/v1/weights")
def sync_all_weights():
    """:func:`sync_weights` for every backend of the key's own tenant (the operator's: every
    backend; or those of ``model``), one
    after another, so the others keep serving while each one loads. Answers each backend's
    record; 409 if any failed its check."""
    body = BackendWeightsSchema().load(json_body())
    probe = _probe(body)
    me = None if g.get("prorl_operator", True) else g.get("prorl_tenant")
    targets = [b["id"] for b in services().backends.list() if (me is None or b["tenant"] == me)
               and (not body.get("model") or b["model"] == body["model"])]
    if not targets:
        raise ApiError(404, "not_found", "no backend is registered" +
                       (f" for model {body['model']!r}" if body.get("model") else ""))
    out = [_sync(b, body, probe) for b in targets]
    bad = [b for b in out if b["weights"]["error"]]
    if bad:
        raise ApiError(409, "weights_mismatch", "; ".join(f"{b['id']}: {b['weights']['error']}"
                                                          for b in bad), {"backends": out})
    return {"backends": out}
