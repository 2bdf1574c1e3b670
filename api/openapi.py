"""The OpenAPI document, built from the marshmallow schemas (GET /openapi.json)."""

from __future__ import annotations

import copy
import re
import threading

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from flask import Blueprint, current_app

from api import schemas as s
from prorl_farm import __version__

bp = Blueprint("openapi", __name__)

_plugin = MarshmallowPlugin()
_spec = APISpec(title="prorl-farm", version=__version__, openapi_version="3.0.3",
                plugins=[_plugin])
for _name in ("Submit", "SubmitResponse", "Job", "Batch", "BatchList", "Results",
              "ManyResultsQuery", "ManyResults", "CancelResponse", "Error", "BackendRegister",
              "BackendResume", "Backend", "BackendWeights"):
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


_submit = _op("Submit jobs", 202, "Submit", "SubmitResponse")
_submit["responses"]["429"] = {
    "description": "over the tenant's quota: nothing was enqueued; try again after "
    "Retry-After seconds", "headers": {"Retry-After": {"schema": {"type": "integer"}}},
    "content": {"application/json": {"schema": _ref("Error")}}}
_spec.path("/v1/jobs", operations={"post": _submit})
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
_spec.path("/v1/batches/results", operations={"post": _op(
    "Finished results of several batches, each after its cursor, in one (long-polled) read",
    body="ManyResultsQuery", out="ManyResults")})
_spec.path("/v1/batches/{batch_id}/stats", operations={"get": _op(
    "Progress, rate and ETA, reward mean and distribution, failures by kind with examples",
    params=[_path_param("batch_id")])})
_spec.path("/v1/overview", operations={"get": _op(
    "The farm at a glance: queues, stage waits, pools, backends, sandboxes, newest batches",
    params=[{"in": "query", "schema": s.OverviewQuerySchema}])})
_spec.path("/v1/history", operations={"get": _op(
    "The farm a minute at a time: jobs ended by state, failures, rewards, waits, backends",
    params=[{"in": "query", "schema": s.HistoryQuerySchema}])})
_spec.path("/v1/batches/{batch_id}/cancel", operations={
    "post": _op("Cancel a batch", params=[_path_param("batch_id")])})
_spec.path("/v1/batches/{batch_id}/ack", operations={"post": _op(
    "Acknowledge a complete batch: its trajectories' payloads are deleted from the store "
    "(409 batch_incomplete while jobs are left)", params=[_path_param("batch_id")])})
_spec.path("/v1/handlers", operations={"get": _op("List handlers")})
_spec.path("/v1/tenants", operations={"get": _op(
    "Tenants: weight, quotas and usage now (jobs queued and in flight, store MB)")})
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
_spec.path("/v1/backends/{backend_id}/weights", operations={
    "post": _op("Weight sync: drain, load the engine's way, reset its prefix cache, check the "
                "served logprobs against the checkpoint's, resume at the new version (409 "
                "weights_mismatch: kept out of the heap)", body="BackendWeights", out="Backend",
                params=[_path_param("backend_id")])})
_spec.path("/v1/weights", operations={
    "post": _op("Weight sync of every backend (or of one model), one at a time",
                body="BackendWeights")})
for _p, _summary in (("/healthz", "Process up"), ("/readyz", "Redis and pools ready"),
                     ("/metrics", "Prometheus metrics")):
    _spec.path(_p, operations={"get": _op(_summary)})
_DOC = _spec.to_dict()
_DOC["paths"]["/readyz"]["get"]["responses"]["503"] = {"description": "not ready"}
# The results pages also come as one Arrow table (Accept: application/vnd.apache.arrow.stream;
# prorl_farm/columns.py): a row per job, its document in ``job`` (the result without the
# payload), the arrays as typed list columns, the rest of the payload as JSON in ``rest``,
# the page's cursor and counts in the schema's metadata under ``prorl.page``.
for _p, _method in (("/v1/batches/{batch_id}/results", "get"), ("/v1/batches/results", "post")):
    _DOC["paths"][_p][_method]["responses"]["200"]["content"][
        "application/vnd.apache.arrow.stream"] = {"schema": {
            "type": "string", "format": "binary",
            "description": "Arrow IPC stream: columns job, prompt_ids, response_ids, "
                           "response_mask, response_logprobs, rest; page meta in the schema "
                           "metadata (prorl.page)"}}
_DOC["paths"]["/v1/jobs"]["post"]["responses"]["200"] = {
    "description": "replayed: an earlier submit with this idempotency_key made these jobs",
    "content": {"application/json": {"schema": _ref("SubmitResponse")}}}
# Bounds that exclude their limit (marshmallow's min_inclusive=False), in OpenAPI 3.0 terms.
for _schema, _field in (("Submit", "deadline_s"), ("Sampling", "top_p"),
                        ("Sampling", "repetition_penalty"), ("BackendWeights", "tolerance")):
    _prop = _DOC["components"]["schemas"][_schema]["properties"][_field]
    _prop["exclusiveMinimum"] = True


def _inline(node, components: dict):
    """Replace every ``$ref`` to a component by the component itself (no cycles here)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            return _inline(components[ref.rsplit("/", 1)[1]], components)
        return {k: _inline(v, components) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, components) for v in node]
    return node


def json_schema(schema_cls) -> dict:
    """JSON Schema of a marshmallow schema, self-contained (nested schemas inlined)."""
    spec = APISpec(title="x", version="1", openapi_version="3.0.3",
                   plugins=[MarshmallowPlugin()])
    spec.components.schema("Root", schema=schema_cls)
    components = spec.to_dict()["components"]["schemas"]
    return _inline(components["Root"], components)


def handler_schema(handler, settings=None) -> dict:
    """A handler's instance schema as JSON Schema, with its cross-field constraints and
    what this farm's settings allow of it."""
    schema = (json_schema(handler.instance_schema) if handler.instance_schema
              else {"type": "object"})
    schema = {**schema, **handler.instance_constraints}
    for name, published in handler.property_schemas.items():
        schema["properties"][name] = published
    if settings is not None:
        for name, rule in handler.allowed_by(settings).items():
            schema["properties"][name] = {**schema["properties"][name], **rule}
    return schema


def build_openapi(registry, settings=None) -> dict:
    """The document for an app with these handlers: a submission is one of the handlers,
    each with its instance schema, given as ``instance`` or as ``instances``."""
    doc = copy.deepcopy(_DOC)
    submit = doc["components"]["schemas"]["Submit"]
    variants = []
    for name in registry.names():
        handler = registry.get(name)
        instance = handler_schema(handler, settings)
        for key, value in (("instance", instance),
                           ("instances", {"type": "array", "minItems": 1, "items": instance})):
            variants.append({"type": "object", "required": ["handler", key],
                             "not": {"required": ["instances" if key == "instance"
                                                  else "instance"]},
                             "properties": {"handler": {"type": "string", "enum": [name]},
                                            key: value}})
    submit["oneOf"] = variants
    return doc


def for_caller(doc: dict, tenants) -> dict:
    """The document as the caller reads it: the tenants its key may submit (and register
    backends) for as the ``tenant`` fields' values (the operator: all of them; a tenant's
    key: its own and those its ``may_use`` names; nothing of the others: api/access.py)."""
    from api.access import sees

    visible = sees()
    names = sorted(tenants if visible is None else set(tenants) & visible)
    schemas = dict(doc["components"]["schemas"])
    for name in ("Submit", "BackendRegister"):
        schema = schemas[name]
        tenant = {**schema["properties"]["tenant"], "enum": [*names, None]}
        schemas[name] = {**schema, "properties": {**schema["properties"], "tenant": tenant}}
    return {**doc, "components": {**doc["components"], "schemas": schemas}}


_docs_lock = threading.Lock()


@bp.get("/openapi.json")
def openapi():
    ext = current_app.extensions
    if "prorl_openapi" not in ext:
        with _docs_lock:
            if "prorl_openapi" not in ext:
                ext["prorl_openapi"] = with_access(build_openapi(
                    ext["prorl"].registry, ext["prorl"].settings), current_app.url_map)
    return for_caller(ext["prorl_openapi"], ext["prorl"].tenants)


def with_access(doc: dict, url_map) -> dict:
    """Each operation's access rule (api/access.py) as ``x-prorl-access`` (``open``, ``key``,
    ``owner``, ``backend``, ``operator``), and the bearer key it needs (when the farm has
    keys)."""
    from api.access import OPEN, RULES

    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for rule in url_map.iter_rules():
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            op = doc["paths"].get(path, {}).get(method.lower())
            if op is None:
                continue
            access = RULES.get(rule.endpoint, "refused")
            op["x-prorl-access"] = access
            if access != OPEN:
                op["security"] = [{"bearer": []}]
    return doc
