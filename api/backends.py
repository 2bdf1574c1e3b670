"""LLM backends: register, list, get, unregister, drain, resume."""

from __future__ import annotations

from flask import Blueprint, request

from api.errors import ApiError
from api.schemas import BackendRegisterSchema, BackendResumeSchema, RegisterQuerySchema
from api.services import json_body, services
from prorl_farm.access import backend_url_refusal
from prorl_farm.llm.registry import BackendSpec, probe

bp = Blueprint("backends", __name__)


@bp.post("/v1/backends")
def register():
    """Probe the backend's health route, then register it: healthy and in the heap if it
    answered, else ``healthy: false`` with the error (it joins the heap once a later probe
    succeeds). With ``?probe=strict`` an unhealthy backend is refused (422, nothing stored).
    """
    query = RegisterQuerySchema().load(request.args.to_dict())
    spec = BackendSpec(**BackendRegisterSchema().load(json_body()))
    svc = services()
    refusal = backend_url_refusal(spec.url, svc.allow_list, svc.settings.redis_url)
    if refusal:
        raise ApiError(403, "backend_not_allowed", f"url: {refusal}", {"url": [refusal]})
    error = probe(spec.url)
    if error and query["probe"] == "strict":
        raise ApiError(422, "backend_unhealthy", f"url: {error}", {"url": [error]})
    backend_id = services().backends.register(spec, probe_error=error)
    return services().backends.get(backend_id), 201


@bp.get("/v1/backends")
def list_backends():
    return {"backends": services().backends.list()}


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
    return services().backends.resume(backend_id, body["policy_version"])
