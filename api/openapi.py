"""The OpenAPI document, built from the marshmallow schemas (GET /openapi.json)."""

from __future__ import annotations

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Blueprint

from api import schemas as s
from prorl_farm import __version__

bp = Blueprint("openapi", __name__)

_plugin = MarshmallowPlugin()
_spec = APISpec(title="prorl-farm", version=__version__, openapi_version="3.0.3",
                plugins=[_plugin])
for _name in ("Submit", "SubmitResponse", "Job", "Batch", "BatchList", "Results",
              "CancelResponse", "Error", "BackendRegister", "BackendResume", "Backend"):
    _spec.components.schema(_name, schema=getattr(s, f"{_name}Schema"))


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _op(summary: str, ok: int = 200, body: str | None = None, out: str | None = None,
        params: list | None = None) -> dict:
    op: dict = {"summary": summary, "responses": {
        str(ok): {"description": "OK", "content": {"application/json": {"schema": _ref(out)}}}
        if out else {"description": "OK"},
        "4XX": {"description": "caller error",
                "content": {"application/json": {"schema": _ref("Error")}}},
    }}
    if body:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": _ref(body)}}}
    if params:
        op["parameters"] = params
    return op


def _path_param(name: str) -> dict:
    return {"in": "path", "name": name, "required": True, "schema": {"type": "string"}}


_spec.path("/v1/jobs", operations={"post": _op("Submit jobs", 202, "Submit", "SubmitResponse")})
_spec.path("/v1/jobs/{job_id}", operations={
    "get": _op("Get a job", out="Job", params=[_path_param("job_id")])})
_spec.path("/v1/jobs/{job_id}/cancel", operations={
    "post": _op("Cancel a job", out="CancelResponse", params=[_path_param("job_id")])})
_spec.path("/v1/batches/{batch_id}", operations={
    "get": _op("Batch summary", out="Batch", params=[_path_param("batch_id")])})
_spec.path("/v1/batches", operations={"get": _op(
    "Recent batches, newest first", out="BatchList",
    params=[{"in": "query", "schema": s.BatchListQuerySchema}])})
_spec.path("/v1/batches/{batch_id}/results", operations={"get": _op(
    "Finished results after a cursor", out="Results",
    params=[_path_param("batch_id"), {"in": "query", "schema": s.ResultsQuerySchema}])})
_spec.path("/v1/batches/{batch_id}/cancel", operations={
    "post": _op("Cancel a batch", params=[_path_param("batch_id")])})
_spec.path("/v1/handlers", operations={"get": _op("List handlers")})
_spec.path("/v1/backends", operations={
    "post": _op("Register an LLM backend (probed first)", 201, "BackendRegister", "Backend",
                params=[{"in": "query", "schema": s.RegisterQuerySchema}]),
    "get": _op("List backends with in-flight counts, health, latency, policy version")})
_spec.path("/v1/backends/{backend_id}", operations={
    "get": _op("Get a backend", out="Backend", params=[_path_param("backend_id")]),
    "delete": _op("Unregister a backend", params=[_path_param("backend_id")])})
_spec.path("/v1/backends/{backend_id}/drain", operations={
    "post": _op("Drain: no new jobs", out="Backend", params=[_path_param("backend_id")])})
_spec.path("/v1/backends/{backend_id}/resume", operations={
    "post": _op("Resume with a new policy version", body="BackendResume", out="Backend",
                params=[_path_param("backend_id")])})
for _p, _summary in (("/healthz", "Process up"), ("/readyz", "Redis and pools ready"),
                     ("/metrics", "Prometheus metrics")):
    _spec.path(_p, operations={"get": _op(_summary)})
_DOC = _spec.to_dict()
# What marshmallow checks beyond each field: exactly one of instance / instances, each an
# object; a backend URL is http(s).
_submit = _DOC["components"]["schemas"]["Submit"]
_submit["oneOf"] = [{"required": ["instance"]}, {"required": ["instances"]}]
_submit["properties"]["instance"]["type"] = "object"
_submit["properties"]["instances"]["items"] = {"type": "object"}
_DOC["components"]["schemas"]["BackendRegister"]["properties"]["url"]["pattern"] = (
    r"^https?://[^/\s:]+(:\d{1,5})?(/\S*)?$")


def json_schema(schema_cls) -> dict:
    """JSON Schema of a marshmallow schema (for handler instance schemas)."""
    return _plugin.converter.schema2jsonschema(schema_cls)


@bp.get("/openapi.json")
def openapi():
    return _DOC
