"""Every Redis key the farm uses, built in this one module. All start with ``prorl:``.

Lua scripts never spell a key: they get the table ``K`` from :data:`LUA`, generated from
the definitions below (constants as strings, per-id keys as functions), so a key's name
lives in one place for Python and Lua alike.
"""

from __future__ import annotations

import json

PREFIX = "prorl:"

# -- jobs -------------------------------------------------------------------------------


def job(job_id: str) -> str:
    """Hash: one job's fields (the field names: states.py)."""
    return f"{PREFIX}job:{job_id}"


# The farm's own Redis servers (`up`, compose, Slurm's head) keep hash values up to this
# many bytes in the compact listpack encoding (Redis's default: 64): a finished job's hash,
# its result summary a few hundred bytes, then takes about 1.3 KB instead of 2.2-2.8 KB.
HASH_MAX_LISTPACK_VALUE = 1024


def instance(instance_id: str) -> str:
    """String: one submitted instance's JSON, shared by its n samples."""
    return f"{PREFIX}instance:{instance_id}"


def sampling(sampling_id: str) -> str:
    """String: one request's sampling parameters (JSON), shared by all of its jobs (kept
    out of the job hash, which it would push out of Redis's compact encoding)."""
    return f"{PREFIX}sampling:{sampling_id}"


def batch(batch_id: str) -> str:
    """Hash: ``total``, ``created_at``, ``handler``, ``left`` (jobs not ended yet),
    ``tenant``."""
    return f"{PREFIX}batch:{batch_id}"


def tenant(name: str) -> str:
    """Hash of a tenant's usage (prorl_farm/tenants.py): its jobs per state (kept by the
    scripts that move jobs, lua/lib/jobs.lua) and ``store_bytes``."""
    return f"{PREFIX}tenant:{name}"


# Set: the tenants that ever submitted (their usage is listed).
TENANTS = f"{PREFIX}tenants"


def batch_counts(batch_id: str) -> str:
    """Counter array (prorl_farm/counters.py): the number of the batch's jobs in each state,
    at ``states.STATE_SLOT``. (Named apart from the hash an older farm kept: a counter
    array written over one would fail WRONGTYPE.)"""
    return f"{PREFIX}batch:{batch_id}:state_counts"


def idempotency(key: str) -> str:
    """String: a submission's idempotency key -> JSON {digest, batch_id, job_ids} (or
    {digest, pending} while that submission is being written)."""
    return f"{PREFIX}idem:{key}"


def batch_jobs(batch_id: str) -> str:
    """List: the batch's job ids in submission order."""
    return f"{PREFIX}batch:{batch_id}:jobs"


def batch_stream(batch_id: str) -> str:
    """Stream: one entry (``job``, ``state``) per job that reached a terminal state."""
    return f"{PREFIX}batch:{batch_id}:stream"


def queued(queue: str) -> str:
    """Sorted set: job -> when its message was pushed onto ``queue`` (a Redis time taken in
    the script or transaction that pushed it, or after a push of the caller's: an upper
    bound of the push); removed when claimed or terminal. A job whose message is not
    pushed yet is not here: a heartbeat in ACTIVE stands for it until it is."""
    return f"{PREFIX}queued:{queue}"


# -- fair share (lua/lib/fair.lua, docs/sharing.md) ---------------------------------------


def pen(queue: str, flow: str) -> str:
    """Sorted set: job -> its place (when it came, less its priority's head start) among
    the flow's jobs waiting for a slot of ``queue``; its message waits in
    :func:`pen_messages` until the pick pushes it. A flow is one batch's jobs:
    ``<tenant>|<head start>|<batch>`` (:func:`flow_tenant`)."""
    return f"{PREFIX}fair:{queue}:pen:{flow}"


def flow_tenant(flow: str) -> str | None:
    """The tenant of a flow (a field of :func:`held`, a member of :func:`pen_flows`); None
    for the held table's own fields (``#shared``, ``#reserve``)."""
    tenant, sep, _ = flow.partition("|")
    return tenant if sep else None


def pen_messages(queue: str) -> str:
    """Hash: job -> the message it pushes onto ``queue`` when it gets a slot (kept apart
    from the job's hash, which it would push out of Redis's compact encoding)."""
    return f"{PREFIX}fair:{queue}:messages"


def pen_flows(queue: str) -> str:
    """Set: the flows with jobs in a pen of ``queue``."""
    return f"{PREFIX}fair:{queue}:flows"


def held(queue: str) -> str:
    """Hash: flow -> the slots of ``queue`` its jobs hold (a message pushed, until the
    job leaves the stage); ``#shared`` and ``#reserve``: the slots the queue's live pools
    register, summed when a registration changed them or, for renewals, at most once a
    second (``#swept``: when; lua/fair_fill.lua)."""
    return f"{PREFIX}fair:{queue}:held"


def slots(queue: str) -> str:
    """Hash: pool process -> "<slots> <reserve> <until>": the slots each live pool process
    that consumes ``queue`` shares out (its concurrency times its prefetch), the slots it
    keeps in reserve for tenants under their share, and when its registration lapses
    (epoch s; it renews it each pool beat)."""
    return f"{PREFIX}fair:{queue}:slots"


# Hash: tenant -> weight (written from the settings by every farm process as it starts).
WEIGHTS = f"{PREFIX}fair:weights"
# Hash: "<stage>:<tenant>:reserve" -> reserve slots handed to the tenant's jobs (farm
# lifetime).
FAIR_GIVEN = f"{PREFIX}metrics:fair-given"


def moved(holder: str) -> str:
    """Counter: bumped whenever a job the worker process ``holder`` (its presence name) holds
    is taken from it (cancelled, failed by its deadline, re-queued by the reaper): the
    process then beats its jobs at once and learns which to abort (worker/liveness.py)."""
    return f"{PREFIX}moved:{holder}"


def janitor_lock(node: str) -> str:
    """String: held by the pool process running the node's sandbox janitor right now."""
    return f"{PREFIX}janitor:{node}"


# Sorted set: batch id -> creation time (GET /v1/batches lists the newest).
BATCHES = f"{PREFIX}batches"
# Set: names of every queue a job was ever put on (the reaper walks these).
QUEUES = f"{PREFIX}queues"
# Sorted set: job -> last heartbeat of the worker that holds it (reserved or running).
ACTIVE = f"{PREFIX}active"
# Sorted set: job -> absolute deadline (epoch seconds).
DEADLINES = f"{PREFIX}deadlines"
# Sorted set: "<stage>:<node>" -> last heartbeat of any pool of that stage on that node.
POOLS = f"{PREFIX}pools"
# Hash: "<stage>.<node>" queue -> when the last pool consuming it left its node (epoch s,
# Redis's clock): lua/leave_sweep.lua marks it, a pool registering slots of it clears it; the
# reaper hands back at once what waits there with no live pool (worker/reaper.py).
LEFT = f"{PREFIX}left"
# Client name of each worker process's presence connection (worker/liveness.py):
# "<prefix><stage>:<node>:<host>:<pid>:<random>".
PRESENCE_PREFIX = "prorl-worker:"
# String: a counter written just before a WAIT for a replica (jobs/store.py, replicated).
REPLICATED = f"{PREFIX}replicated"
# Hash: a Redis primary's replication id -> when a reaper first met it (Redis's clock): a
# replica promoted by Sentinel has a new id, and presence is not trusted just after it.
PRIMARY_SINCE = f"{PREFIX}primary_since"
# Hash: state -> jobs in it now; terminal states count up (the farm's lifetime totals).
STATE_COUNTS = f"{PREFIX}metrics:states"
# Hash: failure kind -> jobs that failed with it (farm lifetime).
FAILURE_KINDS = f"{PREFIX}metrics:failures"
# Hash: "<mode>:<outcome>" -> reaper actions (re-queues, failures, expired deadlines).
REAPER_ACTIONS = f"{PREFIX}metrics:reaper"
# Hash: node -> sandboxes started there (farm lifetime).
SANDBOXES_STARTED = f"{PREFIX}metrics:sandboxes-started"
# Set: histogram names of API routes ("api:<method>:<route>") that served a request.
API_ROUTES = f"{PREFIX}metrics:api-routes"
# Set: every node that ever started a sandbox (where /metrics looks for live ones).
SANDBOX_NODES = f"{PREFIX}metrics:sandbox-nodes"


def histogram(name: str) -> str:
    """Counter array (prorl_farm/counters.py): a histogram's buckets (not cumulative, slot
    ``i - 1`` for bucket ``i``) and its sum in microseconds (``metrics.SUM_SLOT``)."""
    return f"{PREFIX}metrics:histogram:{name}"


def history(minute: str) -> str:
    """Hash: the farm's counters of one minute (``minute``: its start, epoch seconds) for the
    dashboard's history (prorl_farm/history.py): jobs ended by state, failures by kind,
    rewards, stage waits, backend load and latency; expires ``history.TTL_S`` after its
    last write."""
    return f"{PREFIX}history:{minute}"


# Hash: ``n:<stage>``, ``sum:<stage>``: the count and sum (microseconds) of each stage's wait
# histogram when the dashboard's history last took its waits from it (lua/history_waits.lua).
HISTORY_WAITS_SEEN = f"{PREFIX}history:waits-seen"

# Hash: ``bytes``, ``files``: what the trajectory store holds (jobs/payloads.py), kept up
# to date as payloads are written and batches acknowledged or expired.
PAYLOAD_STATS = f"{PREFIX}payloads:stats"
# Sorted set: batch id -> when its first payload was written; a batch leaves it when it is
# acknowledged or its payloads expire (the oldest unacknowledged batch is its head).
PAYLOAD_BATCHES = f"{PREFIX}payloads:batches"
# Hash: batch -> its tenant, for the batches with payloads in the store.
PAYLOAD_TENANTS = f"{PREFIX}payloads:tenants"

# String with expiry: the reaper id of the pool process that sweeps (lua/reaper_lead.lua).
REAPER_LEASE = f"{PREFIX}reaper:lease"
# Hash: kombu delivery tag -> time it was settled (a dead worker's message already handled).
SETTLED = f"{PREFIX}reaper:settled"

# -- LLM backends -----------------------------------------------------------------------


def backend(backend_id: str) -> str:
    """Hash: url, kind, model, tokenizer, capacity, policy_version, drained, healthy, ..."""
    return f"{PREFIX}backend:{backend_id}"


# What pinning a job to a backend returns of the backend's hash (lua/backend_acquire.lua).
BACKEND_FIELDS = ("url", "kind", "model", "tokenizer", "policy_version", "logprobs_mode",
                  "max_model_len")


def backend_sync(backend_id: str) -> str:
    """String with expiry: the token of the weight sync under way on the backend (one at a
    time)."""
    return f"{PREFIX}backend:{backend_id}:sync"


# Set: every registered backend id.
BACKENDS = f"{PREFIX}backends:all"
# Sorted set, the min-heap: backend -> the request time one more job would add there
# (lua/lib/backends.lua heap_score); only healthy, undrained ones.
BACKEND_HEAP = f"{PREFIX}backends:heap"


def backend_heap(tenant: str | None) -> str:
    """The min-heap of one tenant's backends (a tenant's jobs go to its own backends only):
    the default tenant's is BACKEND_HEAP itself. lua/lib/backends.lua tenant_heap is the
    same rule."""
    return BACKEND_HEAP if not tenant or tenant == "default" else f"{BACKEND_HEAP}:{tenant}"


# Hash: an engine's normalised endpoint ("<address>:<port>", "local:<port>":
# access.engine_endpoints) -> the tenant whose backends reach it (lua/engine_claim.lua): an
# engine is one tenant's, whatever URL another writes for it.
ENGINES = f"{PREFIX}backends:engines"
# Hash: endpoint -> how many registered backends reach it (the last one gone frees it).
ENGINE_REFS = f"{PREFIX}backends:engine-refs"
# Hash: backend -> in-flight jobs (every backend, in the heap or not).
BACKEND_INFLIGHT = f"{PREFIX}backends:inflight"
# Hash: job -> the backend it is pinned to (sticky routing; cleared when the job ends).
BACKEND_ASSIGN = f"{PREFIX}backends:assign"
# List: acquire audit records (only with PRORL_BACKEND_AUDIT=1, for tests and debugging).
BACKEND_AUDIT = f"{PREFIX}backends:audit"
# String: moving average of every backend's per-request service time (ms), the guess for a
# backend that has served nothing yet.
BACKEND_SERVICE_REF = f"{PREFIX}backends:service_ref"

# -- sandboxes --------------------------------------------------------------------------


def sandbox_slots(node: str) -> str:
    """Hash: loopback slot -> sandbox id, on ``node``."""
    return f"{PREFIX}sandbox-slots:{node}"


def sandbox_tenants(node: str) -> str:
    """Hash: sandbox id -> the tenant its job belongs to, on ``node`` (its tenant's live
    sandboxes count it until the slot is given back)."""
    return f"{PREFIX}sandbox-tenants:{node}"


def sandbox_records(node: str) -> str:
    """Hash: sandbox id -> its JSON record, on ``node``."""
    return f"{PREFIX}sandboxes:{node}"


def warm(node: str) -> str:
    """Hash: warm sandbox handle ("warm-<id>", what its sandbox's record names as its job
    until a job adopts it) -> JSON {key, state, until, status}: the READY stage's sandboxes
    on ``node``, being built or ready (prorl_farm/worker/warm.py)."""
    return f"{PREFIX}warm:{node}"


def graders(node: str) -> str:
    """Hash: warm grader handle ("grader-<id>", what its sandbox's record names as its job)
    -> JSON {until, pid}: the EVAL pools' warm graders on ``node``, each leased until
    ``until`` (prorl_farm/sandbox/warm_graders.py)."""
    return f"{PREFIX}graders:{node}"


def warm_ready(node: str, key: str) -> str:
    """List: the ready warm sandboxes on ``node`` for the jobs whose INIT key is ``key``."""
    return f"{PREFIX}warm:{node}:ready:{key}"


# Hash: "<node>:<hit|miss|built|expired>" -> warm sandboxes handed out, INITs that found
# none ready, built, and stopped unused (farm lifetime).
WARM_STATS = f"{PREFIX}metrics:warm"


def job_sandboxes(node: str, job_id: str) -> str:
    """Set: the ids of a job's sandboxes on ``node`` (an index of sandbox_records)."""
    return f"{PREFIX}sandboxes:{node}:job:{job_id}"


# -- kombu's own keys (its Redis transport; read by the reaper, never written but to settle)
# Hash: delivery tag -> [message, exchange, routing key] of every reserved, unacked message.
KOMBU_UNACKED = "unacked"
# Sorted set: delivery tag -> time it was reserved.
KOMBU_UNACKED_INDEX = "unacked_index"


# -- the Lua view -----------------------------------------------------------------------

_LUA_CONSTANTS = ("QUEUES", "ACTIVE", "DEADLINES", "POOLS", "BATCHES",
                  "BACKENDS", "BACKEND_HEAP", "BACKEND_INFLIGHT", "BACKEND_ASSIGN",
                  "BACKEND_AUDIT", "BACKEND_SERVICE_REF", "ENGINES", "ENGINE_REFS",
                  "STATE_COUNTS", "FAILURE_KINDS", "REAPER_ACTIONS", "WEIGHTS", "FAIR_GIVEN",
                  "HISTORY_WAITS_SEEN", "LEFT")
_LUA_FUNCTIONS = ("job", "instance", "sampling", "batch", "batch_counts", "batch_jobs",
                  "batch_stream", "queued", "backend", "histogram", "history", "tenant",
                  "pen", "pen_messages", "pen_flows", "held", "slots", "moved")


def _lua() -> str:
    lines = ["local K = {}"]
    for name in _LUA_CONSTANTS:
        lines.append(f"K.{name} = {json.dumps(globals()[name])}")
    for name in _LUA_FUNCTIONS:
        fn = globals()[name]
        args = ("x", "y")[:fn.__code__.co_argcount]
        parts = fn(*("\0" for _ in args)).split("\0")
        body = " .. ".join(p for pair in zip([json.dumps(p) for p in parts], [*args, ""])
                           for p in pair if p and p != '""')
        lines.append(f"function K.{name}({', '.join(args)}) return {body} end")
    return "\n".join(lines) + "\n"


# Prepended to every Lua script: the table K of keys.
LUA = _lua()
