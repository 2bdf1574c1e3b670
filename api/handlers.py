"""GET /v1/handlers: names, descriptions and instance schemas (JSON Schema)."""

from __future__ import annotations

from flask import Blueprint

from api.openapi import handler_schema
from api.services import services

bp = Blueprint("handlers", __name__)


@bp.get("/v1/handlers")
def list_handlers():
    registry = services().registry
    out = []
    for name in registry.names():
        h = registry.get(name)
        out.append({"name": name, "description": h.description,
                    "instance_schema": handler_schema(h, services().settings),
                    "visible_fields": list(h.visible_fields) if h.visible_fields is not None
                    else None})
    return {"handlers": out}
