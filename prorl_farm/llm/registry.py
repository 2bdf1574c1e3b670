"""The backend registry and its min-heap: register, list, drain/resume, acquire/release."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import redis

from prorl_farm import keys
from prorl_farm.access import engine_endpoints
from prorl_farm.errors import Conflict, NotFound
from prorl_farm.lua import Scripts

log = logging.getLogger(__name__)

KINDS = ("vllm", "sglang")
# What a backend's logprobs mean unless its registration says otherwise: vLLM's default
# --logprobs-mode, and SGLang's default (temperature-scaled unless the server runs with
# SGLANG_RETURN_ORIGINAL_LOGPROB=1).
DEFAULT_LOGPROBS_MODE = {"vllm": "raw_logprobs", "sglang": "processed_logprobs"}
HEALTH_PATH = "/health"
# Backends probed at once by BackendRegistry.probe_all.
PROBE_THREADS = 16


def _version(raw: str | None) -> int:
    """A stored policy version (an integer; 0 for none)."""
    try:
        return int(raw or 0)
    except ValueError:
        return 0


def _float(raw: dict, name: str) -> float | None:
    """A stored number (None where it is absent or empty)."""
    return float(raw[name]) if raw.get(name) else None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A probe reads the URL it was given and no other: a redirect is an answer of its own
    (an error), never followed to wherever it points."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _get(url: str, timeout_s: float):
    return _OPENER.open(url, timeout=timeout_s)


def probe(url: str, timeout_s: float = 2.0, slow_ok: bool = False) -> str | None:
    """GET the backend's health route: None if it answers 200, else what went wrong.
    ``slow_ok``: no answer within ``timeout_s`` is not a failure (an engine busy serving
    may answer its health route late; a refused connection or an error status is one)."""
    try:
        with _get(url.rstrip("/") + HEALTH_PATH, timeout_s) as resp:
            if resp.status == 200:
                return None
            return f"{HEALTH_PATH} answered {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{HEALTH_PATH} answered {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        if slow_ok and isinstance(reason, TimeoutError):
            return None
        return f"{HEALTH_PATH} unreachable: {reason}"


def context_length(url: str, model: str, timeout_s: float = 2.0) -> int | None:
    """The context length the engine serves ``model`` with: ``max_model_len`` of its entry
    in ``GET /v1/models`` (vLLM's and SGLang's), or None where it does not say."""
    try:
        with _get(url.rstrip("/") + "/v1/models", timeout_s) as resp:
            doc = json.loads(resp.read(1 << 20))
        rows = [m for m in doc.get("data") or [] if isinstance(m, dict)]
        row = next((m for m in rows if m.get("id") == model), rows[0] if rows else {})
        value = row.get("max_model_len")
        return int(value) if isinstance(value, int) and value > 0 else None
    except (urllib.error.URLError, OSError, ValueError, AttributeError, TypeError):
        return None


def not_an_engine(url: str, timeout_s: float = 2.0) -> str | None:
    """Why ``url`` does not answer as an inference server, or None where it does: its
    health route answers 200 and ``GET /v1/models`` a JSON list of models (``{"data":
    [{"id": ...}, ...]}``, as vLLM and SGLang answer). What a tenant's registration asks
    of a URL before anything is stored or sent that would change the engine."""
    error = probe(url, timeout_s)
    if error:
        return error
    try:
        with _get(url.rstrip("/") + "/v1/models", timeout_s) as resp:
            doc = json.loads(resp.read(1 << 20))
        rows = doc.get("data")
        if isinstance(rows, list) and rows and all(
                isinstance(m, dict) and isinstance(m.get("id"), str) for m in rows):
            return None
        return "/v1/models answered no list of models"
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as e:
        return f"/v1/models: {getattr(e, 'reason', None) or e}"


# Files one of which a tokenizer directory holds (transformers' fast and slow formats).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_missing(path: str) -> str | None:
    """Why the tokenizer at ``path`` is gone, by a look at its files (cheap: the probes of
    registered backends make it), or None where it is still there."""
    if not path:
        return "tokenizer: no path"
    if not os.path.isdir(path):
        return f"tokenizer {path}: no such directory"
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return f"tokenizer {path}: none of {', '.join(TOKENIZER_FILES)} is there"
    return None


def tokenizer_error(path: str) -> str | None:
    """Why the tokenizer at ``path`` cannot be loaded as the pools load it (transformers, from
    the local path only), or None if it loads (a registration's check). Loaded once per
    version of its files: a trainer registering many engines of one model pays one load."""
    missing = tokenizer_missing(path)
    if missing:
        return missing
    stamp = tuple((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                  for e in sorted(os.scandir(path), key=lambda e: e.name) if e.is_file())
    return _tokenizer_load_error(path, stamp)


@functools.lru_cache(maxsize=64)
def _tokenizer_load_error(path: str, stamp: tuple) -> str | None:
    """:func:`tokenizer_error`'s load, for the files ``stamp`` describes."""
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, it does not load
        return f"tokenizer {path} does not load: {type(e).__name__}: {e}"[:500]
    return None


@dataclass(frozen=True)
class BackendSpec:
    url: str
    kind: str
    model: str
    tokenizer: str
    capacity: int = 1
    policy_version: int = 0
    logprobs_mode: str = ""
    max_model_len: int = 0  # tokens of context the engine serves (0: unknown)
    # Whose backend it is: only that tenant's jobs are pinned to it (its own heap).
    tenant: str = "default"


@dataclass(frozen=True)
class Backend:
    """What a worker needs to talk to a backend, read with every pin (:meth:`pin`)."""

    id: str
    url: str
    kind: str
    model: str
    tokenizer: str
    policy_version: int
    logprobs_mode: str
    in_flight: int = 0  # jobs pinned to it when this pin was read (this one included)
    max_model_len: int = 0  # the engine's context length (0: unknown)


# What a registration of another tenant's engine is told (naming neither the tenant nor
# its backend).
ENGINE_TAKEN = ("the engine at this URL is registered by another owner's backend: an "
                "engine serves one tenant")


class BackendRegistry:
    def __init__(self, client: redis.Redis, audit: bool = False):
        self.r = client
        self.audit = audit
        self.lua = Scripts(client)

    # -- registration ---------------------------------------------------------------------

    def _claim(self, tenant: str, endpoints: list[str]) -> bool:
        """Claim the engine ``endpoints`` for ``tenant``'s backend, all or none: False where
        one is another tenant's (lua/engine_claim.lua)."""
        return bool(self.lua("engine_claim", mode="claim", tenant=tenant,
                             endpoints=endpoints)) if endpoints else True

    def _let_go(self, tenant: str, endpoints: list[str]) -> None:
        if endpoints:
            self.lua("engine_claim", mode="release", tenant=tenant, endpoints=endpoints)

    def register(self, spec: BackendSpec, probe_error: str | None = "") -> str:
        """Register a backend, once the engine its URL reaches (access.engine_endpoints,
        however the URL spells it) is claimed for its tenant: Conflict ``engine_taken``
        where another tenant's backend reaches it, nothing stored (an engine serves one
        tenant; the claim goes with its last backend). ``probe_error``: what probing it at
        registration found (None or "" = healthy; see :func:`probe`); an unhealthy backend
        stays out of the heap until the reaper's background probe finds it healthy."""
        endpoints = engine_endpoints(spec.url)
        if not self._claim(spec.tenant, endpoints):
            raise Conflict("engine_taken", ENGINE_TAKEN)
        try:
            return self._register(spec, probe_error, endpoints)
        except BaseException:
            self._let_go(spec.tenant, endpoints)
            raise

    def _register(self, spec: BackendSpec, probe_error: str | None, endpoints: list[str]
                  ) -> str:
        backend_id = uuid.uuid4().hex[:12]
        fields = asdict(spec)
        fields["engine"] = " ".join(endpoints or [])
        fields["logprobs_mode"] = spec.logprobs_mode or DEFAULT_LOGPROBS_MODE[spec.kind]
        fields.update(id=backend_id, healthy=0 if probe_error else 1, drained=0,
                      registered_at=f"{time.time():.3f}", jobs_total=0, requests_total=0,
                      last_error=(probe_error or "")[:500])
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.backend(backend_id), mapping=fields)
        pipe.sadd(keys.BACKENDS, backend_id)
        pipe.hset(keys.BACKEND_INFLIGHT, backend_id, 0)
        # In (or out of) the heap in the same transaction: no reader ever sees it listed,
        # healthy, and not yet in the heap.
        self.lua("backend_update", client=pipe, backend=backend_id, fields=[])
        pipe.execute()
        log.info("registered %s backend %s at %s (capacity %d)", spec.kind, backend_id,
                 spec.url, spec.capacity)
        return backend_id

    def unregister(self, backend_id: str) -> None:
        """Remove a backend; jobs pinned to it fail over at their next turn."""
        self._require(backend_id)
        tenant, engine = self.r.hmget(keys.backend(backend_id), "tenant", "engine")
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem(keys.backend_heap(tenant), backend_id)
        pipe.delete(keys.backend(backend_id))
        pipe.srem(keys.BACKENDS, backend_id)
        pipe.hdel(keys.BACKEND_INFLIGHT, backend_id)
        deleted = pipe.execute()[1]
        if deleted:  # this call removed it: its engines' claim goes with it (once)
            self._let_go(tenant or "default", (engine or "").split())

    def _update(self, backend_id: str, **fields) -> bool:
        """Set fields and re-place the backend in (or out of) the heap; False if unknown.
        Raises Conflict for a ``policy_version`` lower than the backend's."""
        flat = [x for kv in fields.items() for x in (kv[0], str(kv[1]))]
        out = self.lua("backend_update", backend=backend_id, fields=flat)
        if out == -2:
            raise Conflict("policy_version_regressed", f"backend {backend_id}: policy_version "
                           f"{fields.get('policy_version')} is lower than its current "
                           f"{self.get(backend_id)['policy_version']} (versions only grow)")
        return out >= 0

    def drain(self, backend_id: str) -> dict:
        """No new jobs; jobs already pinned finish (e.g. before a weight sync)."""
        if not self._update(backend_id, drained=1):
            raise NotFound(f"backend {backend_id!r} not found")
        return self.get(backend_id)

    def resume(self, backend_id: str, policy_version: int) -> dict:
        """Take new jobs again, sampling under ``policy_version`` from now on (not lower
        than the current one: Conflict; nor while its weights failed their check)."""
        error = self.r.hget(keys.backend(backend_id), "weights_error")
        if error:
            raise Conflict("weights_mismatch", f"backend {backend_id} stays out until a "
                           f"weight sync passes its check: {error}")
        if not self._update(backend_id, drained=0, policy_version=policy_version):
            raise NotFound(f"backend {backend_id!r} not found")
        return self.get(backend_id)

    def set_fields(self, backend_id: str, **fields) -> None:
        """Record fields (weights state, context length) and re-place it in the heap."""
        if not self._update(backend_id, **fields):
            raise NotFound(f"backend {backend_id!r} not found")

    def mark_unhealthy(self, backend_id: str, error: str) -> None:
        if self._update(backend_id, healthy=0, last_error=error[:500]):
            log.warning("backend %s left the heap: %s", backend_id, error)

    def mark_healthy(self, backend_id: str) -> None:
        if self._update(backend_id, healthy=1, last_error=""):
            log.info("backend %s is healthy again", backend_id)

    # -- reads ----------------------------------------------------------------------------

    def _require(self, backend_id: str) -> None:
        if not self.r.exists(keys.backend(backend_id)):
            raise NotFound(f"backend {backend_id!r} not found")

    def get(self, backend_id: str) -> dict:
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.backend(backend_id))
        pipe.hget(keys.BACKEND_INFLIGHT, backend_id)
        raw, inflight = pipe.execute()
        if not raw:
            raise NotFound(f"backend {backend_id!r} not found")
        score = self.r.zscore(keys.backend_heap(raw.get("tenant")), backend_id)
        return self._render(raw, inflight, score)

    def tenant_of(self, backend_id: str) -> str | None:
        """Whose backend it is (None: not registered)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.exists(keys.backend(backend_id))
        pipe.hget(keys.backend(backend_id), "tenant")
        exists, tenant = pipe.execute()
        return (tenant or "default") if exists else None

    @staticmethod
    def _render(raw: dict, inflight, score) -> dict:
        return {
            "id": raw["id"], "url": raw["url"], "kind": raw["kind"], "model": raw["model"],
            "tenant": raw.get("tenant") or "default",
            "tokenizer": raw["tokenizer"], "capacity": int(raw["capacity"]),
            "policy_version": _version(raw["policy_version"]),
            "logprobs_mode": raw["logprobs_mode"],
            "healthy": raw["healthy"] == "1", "drained": raw["drained"] == "1",
            "in_heap": score is not None, "in_flight": int(inflight or 0),
            "load": int(inflight or 0) / max(1, int(raw["capacity"])),
            # The heap's key: the request time one more job adds there (absent out of it).
            "expected_delay_ms": round(float(score), 3) if score is not None else None,
            "latency_ms": _float(raw, "latency_ms"),
            "service_ms": _float(raw, "service_ms"),
            "jobs_total": int(raw.get("jobs_total", 0)),
            "requests_total": int(raw.get("requests_total", 0)),
            "last_error": raw.get("last_error") or None,
            "registered_at": float(raw["registered_at"]),
            "max_model_len": _version(raw.get("max_model_len")) or None,
            "weights": {
                "path": raw.get("weights_path") or None,
                "error": raw.get("weights_error") or None,
                "max_error": _float(raw, "weights_max_error"),
                "checked_at": _float(raw, "weights_checked_at"),
                "load_s": _float(raw, "weights_load_s"),
            },
        }

    def list(self) -> list[dict]:
        ids = sorted(self.r.smembers(keys.BACKENDS))
        out = []
        for backend_id in ids:
            try:
                out.append(self.get(backend_id))
            except NotFound:
                continue  # unregistered while we listed
        return out

    def in_flight(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.r.hgetall(keys.BACKEND_INFLIGHT).items()}

    # -- the heap -------------------------------------------------------------------------

    def acquire(self, job_id: str, exclude: str = "") -> str | None:
        """The backend this job is pinned to, pinning it to the least-loaded one if needed."""
        out = self.pin(job_id, exclude)
        return out.id if out else None

    def pin(self, job_id: str, exclude: str = "",
            latency: tuple[str, float, int, float | None] | None = None) -> Backend | None:
        """:meth:`acquire`, returning the backend's request fields, and first recording
        ``latency`` (backend id, mean ms, requests, the in-flight count their pins saw or
        None) of the job's earlier requests: one round trip."""
        lat = ((latency[0], f"{latency[1]:.3f}", str(latency[2]),
                "" if latency[3] is None else f"{latency[3]:.3f}") if latency
               else ("", "", "", ""))
        out = self.lua("backend_acquire", job=job_id, exclude=exclude,
                       audit="1" if self.audit else "", latency_backend=lat[0],
                       latency_ms=lat[1], latency_requests=lat[2], latency_load=lat[3])
        if not out:
            return None
        f = dict(zip(keys.BACKEND_FIELDS, out[2:-1]))
        return Backend(out[0], f["url"], f["kind"], f["model"], f["tokenizer"],
                       _version(f["policy_version"]), f["logprobs_mode"], int(out[-1]),
                       _version(f["max_model_len"]))

    def release(self, job_id: str) -> str | None:
        return self.lua("backend_release", job=job_id) or None

    def record_latency(self, backend_id: str, latency_ms: float, requests: int = 1,
                       load: float | None = None) -> None:
        """Fold ``requests`` requests of mean ``latency_ms`` into the backend's averages;
        ``load``: the backend's in-flight count while they ran (now's if None)."""
        self.lua("backend_record_latency", backend=backend_id, latency_ms=f"{latency_ms:.3f}",
                 requests=str(requests), load="" if load is None else f"{load:.3f}")

    def audit_log(self) -> list[dict]:
        """Acquire audit records: the chosen backend, the one the job asked not to get (or
        ''), the jobs pinned to the chosen one before, and the heap's keys as the pick saw
        them."""
        out = []
        for row in self.r.lrange(keys.BACKEND_AUDIT, 0, -1):
            snap = json.loads(row)
            chosen, exclude, in_flight, flat = snap[0], snap[1], snap[2], snap[3:]
            out.append({"chosen": chosen, "exclude": exclude, "in_flight": int(in_flight),
                        "scores": {flat[i]: float(flat[i + 1]) for i in range(0, len(flat), 2)}})
        return out

    # -- health ---------------------------------------------------------------------------

    def probe_unhealthy(self, timeout_s: float = 1.0) -> list[str]:
        """Probe every unhealthy backend (its health route, its tokenizer's files); return
        those back in the heap."""
        return self.probe_all(timeout_s, healthy=False)[1]

    def probe_all(self, timeout_s: float = 2.0, healthy: bool = True
                  ) -> tuple[list[str], list[str]]:
        """Probe the registered backends, the healthy ones too unless ``healthy`` is False:
        one whose server does not answer its health route or whose tokenizer is gone
        leaves the heap (jobs are never pinned to it); an unhealthy one that passes both
        comes back. Run at a pool's start over what a previous life of the farm left
        registered, and every HEALTH_EVERY_S by the reaper. Returns (marked down, back
        up)."""
        down, up = [], []
        targets = [b for b in self.list() if healthy or not b["healthy"]]
        if not targets:
            return down, up

        def check(b: dict) -> str | None:
            # A healthy backend leaves only on a sure sign (its tokenizer's files gone, its
            # connection refused, an error status), never for a slow answer under load.
            return tokenizer_missing(b["tokenizer"]) or probe(b["url"], timeout_s,
                                                              slow_ok=b["healthy"])

        # Side by side: a farm of many engines is probed in about one timeout, not one
        # each (a RUN pool waits for this before it takes a job).
        with ThreadPoolExecutor(max_workers=max(1, min(PROBE_THREADS, len(targets)))) as ex:
            found = list(ex.map(check, targets))
        for b, why in zip(targets, found):
            if why and b["healthy"]:
                self.mark_unhealthy(b["id"], why)
                down.append(b["id"])
            elif not why and not b["healthy"]:
                length = context_length(b["url"], b["model"], timeout_s)
                if length and length != b["max_model_len"]:
                    self.set_fields(b["id"], max_model_len=length)
                self.mark_healthy(b["id"])
                up.append(b["id"])
        return down, up
