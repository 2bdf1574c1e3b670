"""LLM backends: register, list, get, unregister, drain, resume."""

from __future__ import annotations

from flask import Blueprint

from api.schemas import BackendRegisterSchema, BackendResumeSchema
from api.services import json_body, services
from prorl_farm.llm.registry import BackendSpec

bp = Blueprint("backends", __name__)


@bp.post("/v1/backends")
def register():
    spec = BackendSpec(**BackendRegisterSchema().load(json_body()))
    backend_id = services().backends.register(spec)
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
