"""GET /v1/handlers: names, descriptions and instance schemas (JSON Schema)."""

from __future__ import annotations

from flask import Blueprint

from api.openapi import json_schema
from api.services import services

bp = Blueprint("handlers", __name__)


@bp.get("/v1/handlers")
def list_handlers():
    registry = services().registry
    out = []
    for name in registry.names():
        h = registry.get(name)
        schema = json_schema(h.instance_schema) if h.instance_schema else {"type": "object"}
        out.append({"name": name, "description": h.description, "instance_schema": schema})
    return {"handlers": out}
