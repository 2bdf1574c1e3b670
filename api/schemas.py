"""Marshmallow schemas for API v1 requests and responses."""

from __future__ import annotations

from marshmallow import RAISE, Schema, ValidationError, fields, validate, validates_schema

ID_RE = r"^[A-Za-z0-9_.\-]{1,128}$"
# An LLM backend's URL: http(s), a host name or IPv4 address, an optional port, a path.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
URL_RE = rf"^https?://{_LABEL}(?:\.{_LABEL})*(?::{_PORT})?(?:/[A-Za-z0-9._~/-]*)?$"
# A Redis stream id: two unsigned 64-bit integers (19 digits at most stay below 2^64).
CURSOR_RE = r"^\d{1,19}-\d{1,19}$"
# The largest ``wait`` a results request may ask for; the server waits at most
# PRORL_MAX_WAIT_S (default 60) of it.
WAIT_MAX_S = 3600.0


class SamplingSchema(Schema):
    """Sampling parameters shared by every job of a request (passed to LLM backends)."""

    class Meta:
        unknown = RAISE

    temperature = fields.Float(validate=validate.Range(min=0, max=10), allow_nan=False)
    top_p = fields.Float(validate=validate.Range(min=0, max=1, min_inclusive=False))
    top_k = fields.Integer(strict=True, validate=validate.Range(min=-1))
    min_p = fields.Float(validate=validate.Range(min=0, max=1))
    max_tokens = fields.Integer(strict=True, validate=validate.Range(min=1, max=1_000_000))
    max_turns = fields.Integer(strict=True, validate=validate.Range(min=1, max=10_000))
    max_total_tokens = fields.Integer(strict=True, validate=validate.Range(min=1,
                                                                           max=10_000_000),
                                      metadata={"description": "generated tokens per episode, "
                                                "all turns together"})
    context_length = fields.Integer(strict=True, validate=validate.Range(min=16,
                                                                         max=10_000_000),
                                    metadata={"description": "the model's context: a turn "
                                              "that would not fit ends the episode; a job "
                                              "whose agent harness preset needs more (or "
                                              "whose backends all serve less) is refused, "
                                              "400 insufficient_context"})
    seed = fields.Integer(strict=True)
    stop_token_ids = fields.List(fields.Integer(strict=True, validate=validate.Range(min=0)))
    repetition_penalty = fields.Float(validate=validate.Range(min=0, min_inclusive=False))
    presence_penalty = fields.Float(validate=validate.Range(min=-2, max=2))
    frequency_penalty = fields.Float(validate=validate.Range(min=-2, max=2))
    ignore_eos = fields.Boolean(metadata={"description": "keep sampling past the end-of-"
                                          "sequence token, up to max_tokens"})


class SubmitSchema(Schema):
    """POST /v1/jobs: one ``instance`` or a list of ``instances``, each run ``n`` times."""

    class Meta:
        unknown = RAISE

    handler = fields.String(required=True, validate=validate.Length(min=1, max=128))
    instance = fields.Raw(metadata={"description": "a single task instance"})
    instances = fields.List(fields.Raw(), validate=validate.Length(min=1),
                            metadata={"description": "task instances (objects)"})
    n = fields.Integer(load_default=1, strict=True, validate=validate.Range(min=1, max=4096),
                       metadata={"description": "samples per instance; instances x n may be at "
                                 "most PRORL_MAX_JOBS_PER_REQUEST (10000), else 400 "
                                 "too_many_jobs"})
    sampling = fields.Nested(SamplingSchema, load_default=dict)
    deadline_s = fields.Float(load_default=None, allow_none=True, allow_nan=False,
                              validate=validate.Range(min=0, min_inclusive=False,
                                                      max=30 * 24 * 3600),
                              metadata={"description": "seconds from submit until each "
                                        "job fails with timeout"})
    batch_id = fields.String(load_default=None, allow_none=True, validate=validate.Regexp(
        ID_RE, error="1-128 characters from A-Z a-z 0-9 _ . -"),
        metadata={"description": "add to this batch (created if new)"})
    tenant = fields.String(load_default=None, allow_none=True, validate=validate.Regexp(
        r"^[A-Za-z0-9_.-]{1,64}$", error="a tenant's name"),
        metadata={"description": "the tenant the batch belongs to (default: the key's own); "
                  "a key may name its own tenant, those its tenant may_use, or any (the "
                  "operator's key)"})
    priority = fields.Integer(
        load_default=0, strict=True, validate=validate.Range(min=-100, max=100),
        metadata={"description": "the jobs' priority within their tenant's share (-100 to "
                  "100, default 0): a job goes before those of lower priority that came less "
                  "than PRORL_FAIR_AGING_S (60 s) per level before it"})
    mode = fields.String(load_default="policy", validate=validate.OneOf(["policy",
                                                                         "reference"]),
                         metadata={"description": "reference: skip the policy and grade the "
                                   "instance's own reference (answer, canonical solution)"})
    idempotency_key = fields.String(load_default=None, allow_none=True,
                                    validate=validate.Regexp(
                                        ID_RE, error="1-128 characters from A-Z a-z 0-9 _ . -"),
                                    metadata={"description": "a submit retried with the same "
                                              "key and body returns the first one's batch and "
                                              "jobs (200, replayed) instead of new ones; the "
                                              "same key with another body is a 409"})

    @validates_schema
    def _one_of_instance_instances(self, data, **_):
        if ("instance" in data) == ("instances" in data):
            raise ValidationError("give exactly one of 'instance' or 'instances'", "instances")


class SubmitResponseSchema(Schema):
    batch_id = fields.String()
    job_ids = fields.List(fields.String())
    replayed = fields.Boolean(metadata={"description": "true when an earlier submit with the "
                                        "same idempotency_key made these jobs"})
    warnings = fields.Dict(metadata={"description": "what was accepted as it is but said of "
                                     "(fields kept but not used): {\"instances\": [{\"indexes"
                                     "\", \"count\", \"warnings\"}]}"})


class ResultsQuerySchema(Schema):
    class Meta:
        unknown = RAISE

    cursor = fields.String(load_default="0-0", validate=[validate.Regexp(
        CURSOR_RE, error="a stream id like '0-0' or one returned as 'cursor'")],
        metadata={"description": "results after this one ('0-0': from the start)"})
    limit = fields.Integer(load_default=100, validate=validate.Range(min=1, max=1000))
    wait = fields.Float(load_default=0.0, allow_nan=False,
                        validate=validate.Range(min=0, max=WAIT_MAX_S),
                        metadata={"description": "seconds to wait for a result while there "
                                  "is none; the server waits at most PRORL_MAX_WAIT_S "
                                  "(default 60) of it, then answers with no results"})
    payload = fields.Boolean(load_default=True, metadata={
        "description": "with the trajectories' arrays from the store (false: each result "
                       "is the summary Redis keeps)"})


class BatchListQuerySchema(Schema):
    class Meta:
        unknown = RAISE

    limit = fields.Integer(load_default=50, validate=validate.Range(min=1, max=1000))


class OverviewQuerySchema(Schema):
    class Meta:
        unknown = RAISE

    batches = fields.Integer(load_default=10, validate=validate.Range(min=1, max=50),
                             metadata={"description": "how many of the newest batches"})


class HistoryQuerySchema(Schema):
    class Meta:
        unknown = RAISE

    window_s = fields.Float(load_default=3600.0,
                            validate=validate.Range(min=60, max=25 * 3600),
                            metadata={"description": "how far back, in seconds (a point per "
                                      "minute; kept a day)"})


class FailureSchema(Schema):
    kind = fields.String()
    message = fields.String()


class JobSchema(Schema):
    id = fields.String()
    policy_version = fields.Integer(allow_none=True, metadata={
        "description": "the oldest policy version among the job's LLM turns"})
    batch_id = fields.String()
    handler = fields.String()
    state = fields.String(metadata={"enum": ["queued", "init", "run", "eval", "done",
                                             "failed", "cancelled"]})
    stage = fields.String(allow_none=True)
    phase = fields.String()
    node = fields.String(allow_none=True)
    instance_index = fields.Integer()
    sample_index = fields.Integer()
    requeues = fields.Integer()
    mode = fields.String()
    attempts = fields.List(fields.Dict(), metadata={"description": "earlier attempts of a "
                                                     "re-queued job: stage, node, reason"})
    created_at = fields.Float()
    deadline_at = fields.Float(allow_none=True)
    finished_at = fields.Float(allow_none=True)
    timings = fields.Dict()
    failure = fields.Nested(FailureSchema, allow_none=True)
    reward = fields.Float(allow_none=True, metadata={"description": "null unless done"})
    filtered = fields.Boolean()
    result = fields.Raw(allow_none=True)
    instance = fields.Raw()
    sampling = fields.Dict()


class BatchSchema(Schema):
    batch_id = fields.String()
    total = fields.Integer()
    counts = fields.Dict(keys=fields.String(), values=fields.Integer())
    finished = fields.Integer()
    complete = fields.Boolean()
    created_at = fields.Float()
    handler = fields.String(allow_none=True)
    tenant = fields.String(metadata={"description": "the tenant the batch belongs to"})
    priority = fields.Integer(metadata={"description": "its jobs' priority (the last "
                                        "submit's)"})


class ResultsSchema(Schema):
    results = fields.List(fields.Nested(JobSchema))
    cursor = fields.String()
    complete = fields.Boolean(metadata={"description": "every job of the batch finished"})
    finished = fields.Integer()
    total = fields.Integer()


class ManyResultsQuerySchema(Schema):
    class Meta:
        unknown = RAISE

    # Any key: one that names no stored batch (a malformed id included) is found: false.
    cursors = fields.Dict(
        keys=fields.String(),
        values=fields.String(validate=validate.Regexp(
            CURSOR_RE, error="a stream id like '0-0' or one returned as 'cursor'")),
        required=True, validate=validate.Length(max=1000),
        metadata={"description": "batch id -> the cursor to read after ('0-0': from the "
                                 "start)", "maxProperties": 1000})
    limit = fields.Integer(load_default=100, validate=validate.Range(min=1, max=1000),
                           metadata={"description": "results per batch, at most"})
    wait = fields.Float(load_default=0.0, allow_nan=False,
                        validate=validate.Range(min=0, max=WAIT_MAX_S),
                        metadata={"description": "seconds to wait while no incomplete batch "
                                  "has a result (the server waits at most PRORL_MAX_WAIT_S)"})


class BatchResultsSchema(Schema):
    results = fields.List(fields.Nested(JobSchema))
    cursor = fields.String()
    complete = fields.Boolean()
    finished = fields.Integer()
    total = fields.Integer()
    found = fields.Boolean(metadata={"description": "false: no such batch (or expired); "
                                                    "nothing else is set"})


class ManyResultsSchema(Schema):
    batches = fields.Dict(keys=fields.String(), values=fields.Nested(BatchResultsSchema))


class BatchListSchema(Schema):
    batches = fields.List(fields.Nested(BatchSchema))


class CancelResponseSchema(Schema):
    cancelled = fields.Integer(metadata={"description": "jobs this request cancelled"})
    job = fields.Nested(JobSchema)


class ErrorSchema(Schema):
    error = fields.Dict(metadata={"description": "{code, message, details}"})


class BackendRegisterSchema(Schema):
    """POST /v1/backends."""

    class Meta:
        unknown = RAISE

    url = fields.String(required=True, validate=[
        validate.Length(max=2048),
        validate.Regexp(URL_RE, error="an http(s) URL: scheme, host name or IPv4 address, "
                        "optional port and path (e.g. http://gpu-node-3:8000)")])
    kind = fields.String(required=True, validate=validate.OneOf(["vllm", "sglang"]))
    model = fields.String(required=True, validate=validate.Length(min=1, max=512))
    tokenizer = fields.String(required=True, validate=validate.Length(min=1, max=4096),
                              metadata={"description": "local path of the tokenizer, as "
                                        "the workers see it"})
    capacity = fields.Integer(load_default=1, strict=True,
                              validate=validate.Range(min=1, max=100_000))
    policy_version = fields.Integer(load_default=0, strict=True, validate=validate.Range(
        min=0, max=2**53), metadata={"description": "the policy's version (a trainer's step "
                                     "count): an integer that only grows"})
    logprobs_mode = fields.String(load_default="", validate=validate.OneOf(
        ["", "raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]))
    max_model_len = fields.Integer(load_default=0, strict=True, validate=validate.Range(
        min=0, max=100_000_000), metadata={"description": "the engine's context length; "
                                           "0 (default): read from its GET /v1/models"})
    tenant = fields.String(load_default=None, allow_none=True, validate=validate.Length(
        min=1, max=64), metadata={"description": "whose backend it is: only that tenant's "
                                  "jobs are sent to it (default: the key's tenant; a "
                                  "tenant's key may name itself or a tenant its may_use "
                                  "names, the operator's any)"})


class ProbeSchema(Schema):
    class Meta:
        unknown = RAISE

    token_ids = fields.List(fields.Integer(strict=True, validate=validate.Range(min=0)),
                            required=True, validate=validate.Length(min=2, max=65_536))
    logprobs = fields.List(fields.Float(allow_nan=False), required=True, metadata={
        "description": "each token's logprob given those before it, from the trainer's own "
                       "model: one per token after the first"})
    # One logprob per token after the first: checked by the route (422 invalid_probe).


class BackendWeightsSchema(Schema):
    """POST /v1/backends/<id>/weights and /v1/weights."""

    class Meta:
        unknown = RAISE

    path = fields.String(required=True, validate=validate.Length(min=1, max=4096), metadata={
        "description": "the checkpoint's directory (safetensors), as the engine sees it"})
    policy_version = fields.Integer(required=True, strict=True, validate=validate.Range(
        min=0, max=2**53), metadata={"description": "the version these weights are"})
    probe = fields.Nested(ProbeSchema, metadata={
        "description": "token ids and their logprobs under the new weights; without it the "
                       "farm computes them from the checkpoint at path"})
    tolerance = fields.Float(allow_nan=False,
                             validate=validate.Range(min=0, min_inclusive=False, max=100),
                             metadata={"description": "largest logprob error accepted "
                                       "(default PRORL_WEIGHTS_TOLERANCE, 0.01)"})
    verify = fields.Boolean(load_default=True, metadata={
        "description": "false: resume without the check (the backend's weights are then "
                       "taken on trust)"})
    drain_timeout_s = fields.Float(load_default=600.0, allow_nan=False,
                                   validate=validate.Range(min=0, max=24 * 3600))
    mode = fields.String(load_default="drain", validate=validate.OneOf(["drain", "in_place"]),
                         metadata={"description": "drain: wait for every job pinned to the "
                                   "backend, then load (strictly on-policy); in_place: pause "
                                   "the engine, abort what it generates (the turns go on "
                                   "under the new weights from the tokens they have, each "
                                   "token labelled with its version), load, resume"})
    model = fields.String(validate=validate.Length(min=1, max=512), metadata={
        "description": "/v1/weights only: the backends serving this model (default: all)"})


class RegisterQuerySchema(Schema):
    class Meta:
        unknown = RAISE

    probe = fields.String(load_default="lenient", validate=validate.OneOf(["lenient", "strict"]),
                          metadata={"description": "lenient: register an unreachable backend "
                                    "as unhealthy (201); strict: refuse it (422)"})


class BackendResumeSchema(Schema):
    class Meta:
        unknown = RAISE

    policy_version = fields.Integer(required=True, strict=True, validate=validate.Range(
        min=0, max=2**53), metadata={"description": "the version now served; lower than the "
                                     "backend's current one: 409"})


class BackendSchema(Schema):
    id = fields.String()
    url = fields.String()
    kind = fields.String()
    model = fields.String()
    tokenizer = fields.String()
    capacity = fields.Integer()
    policy_version = fields.Integer()
    logprobs_mode = fields.String()
    healthy = fields.Boolean()
    drained = fields.Boolean()
    in_heap = fields.Boolean()
    in_flight = fields.Integer()
    load = fields.Float(metadata={"description": "in_flight / capacity"})
    expected_delay_ms = fields.Float(allow_none=True, metadata={
        "description": "the min-heap's key: the request time one more job would add here, "
                       "its own turn and the queueing it adds to the others' (from "
                       "service_ms, in_flight and capacity); null out of the heap"})
    latency_ms = fields.Float(allow_none=True)
    service_ms = fields.Float(allow_none=True, metadata={
        "description": "moving average of request latency less the queueing its load "
                       "explains"})
    jobs_total = fields.Integer()
    requests_total = fields.Integer()
    last_error = fields.String(allow_none=True)
    registered_at = fields.Float()
    max_model_len = fields.Integer(allow_none=True, metadata={
        "description": "the engine's context length: jobs on it end `context` rather than "
                       "outgrow it"})
    weights = fields.Dict(metadata={
        "description": "the last weight sync: path, error (weights_mismatch: kept out of the "
                       "heap), max_error, checked_at, load_s"})
