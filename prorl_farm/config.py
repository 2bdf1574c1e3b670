"""All settings, read once from PRORL_* environment variables.

Every duration is in seconds and says so in its name (``*_S``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from dataclasses import dataclass, field

from prorl_farm.errors import ConfigError

STAGES = ("init", "run", "eval")
POOL_TYPES = ("threads", "prefork", "solo", "gevent", "eventlet")


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0] or "localhost"


@dataclass(frozen=True)
class PoolSettings:
    """How one stage's worker pool runs."""

    pool: str = "threads"
    concurrency: int = 8
    prefetch_multiplier: int = 1
    timeout_s: float = 600.0


@dataclass(frozen=True)
class Settings:
    """Farm-wide settings; build with :func:`load_settings`."""

    # None: `prorl-farm up` starts a private redis-server of its own.
    redis_url: str | None = None
    node: str = field(default_factory=_short_hostname)
    home: str = ".prorl"
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_workers: int = 2
    api_threads: int = 16
    flower_port: int = 5555
    init: PoolSettings = PoolSettings(concurrency=8, prefetch_multiplier=1, timeout_s=600.0)
    run: PoolSettings = PoolSettings(concurrency=64, prefetch_multiplier=1, timeout_s=3600.0)
    eval: PoolSettings = PoolSettings(concurrency=8, prefetch_multiplier=1, timeout_s=600.0)
    # Finished jobs, batch counters and result streams expire this long after the last change.
    result_ttl_s: float = 7 * 24 * 3600.0
    # Liveness: how often each worker process heartbeats its jobs and checks for aborts,
    # and how old a heartbeat may get before the reaper declares the worker dead.
    heartbeat_interval_s: float = 0.5
    heartbeat_stale_s: float = 30.0
    # A worker process whose presence connection is gone (it died) has its jobs recovered
    # once their heartbeat is this old, without waiting for heartbeat_stale_s.
    presence_grace_s: float = 1.5
    # Off where Redis's client list says nothing about worker processes (a proxy in front
    # of Redis, CLIENT disabled): then only heartbeat age tells a dead worker.
    presence: bool = True
    # A pool whose liveness thread has not turned for this long while its process lives
    # (wedged, e.g. in a C call that never returns) is killed by its watchdog, for its
    # supervisor to restart; 0 turns the watchdog off.
    watchdog_s: float = 60.0
    reap_interval_s: float = 1.0
    # A job whose worker died starts again at INIT at most this many times, then fails worker_lost.
    max_requeues: int = 1
    # API limits.
    max_body_bytes: int = 16 * 1024 * 1024
    max_jobs_per_request: int = 10_000
    max_wait_s: float = 60.0
    # Celery task events (task-received/started/succeeded): Flower shows tasks only with them;
    # they cost three extra publishes per stage, so they are off unless asked for (`prorl-farm
    # up`, which starts Flower, asks for them).
    task_events: bool = False
    # LLM backends: per-request timeout, retries on one backend, fail-overs to others per job;
    # audit=True logs every acquire's heap snapshot (tests, debugging).
    llm_request_timeout_s: float = 600.0
    llm_retries: int = 2
    llm_max_failovers: int = 1
    # A job that finds every backend drained (a weight sync) waits this long for one to be
    # resumed, within its deadline, instead of failing.
    llm_drain_wait_s: float = 600.0
    backend_audit: bool = False
    # A weight sync's check: the largest logprob error (served vs the checkpoint's, on the
    # probe's tokens) a backend may show and still serve the new version. float32 engines
    # agree within 1e-5; bfloat16 small models within about 5e-3.
    weights_tolerance: float = 1e-2
    # Grading a final answer (math, stem) in a helper process: the time and memory an
    # answer may cost before it earns 0 (prorl_farm/graders/answers.py).
    grade_timeout_s: float = 10.0
    grade_memory_mb: int = 1024
    # Sandboxes: runtime (auto = bwrap where installed, else local), where their files live
    # (keep it short: Unix socket paths are limited to 107 bytes), live sandboxes per node.
    sandbox_runtime: str = "auto"
    sandbox_dir: str = "/tmp/prorl-sandboxes"
    sandbox_max: int = 64
    # Who a sandbox runs as on the host: "auto" (nobody when the farm runs as root, else the
    # farm's own uid), a user name or "uid[:gid]"; never root. Inside it is always uid 1000.
    sandbox_user: str = "auto"
    # The interpreter of the tool server inside; "" = the farm's, or the system's python3 of
    # the same version where the sandbox user cannot run the farm's.
    sandbox_python: str = ""
    # Read-only paths in every sandbox: "host[:inside],..."; and the host roots under which
    # handlers and instances may ask for more (nothing else is ever bound on request).
    sandbox_ro_paths: str = ""
    sandbox_mount_roots: str = ""
    # Extra handlers without packaging: "name=module:Class,other=module:Class".
    handlers: str = ""
    # Access. With a token, every mutating API call needs "Authorization: Bearer <token>";
    # read_auth extends that to every read but the probes (/healthz, /readyz).
    api_token: str = ""
    api_read_auth: bool = False
    # Hosts and CIDRs (besides loopback) whose URLs may be registered as LLM backends.
    backend_allow: str = ""
    # Whether an instance may ask for a sandbox with the outside network (shell `network`).
    sandbox_network: bool = False
    # On SIGTERM, re-queue what this pool holds (and what waits on its node's queue) at once
    # instead of finishing it: for nodes that go away with their sandboxes (Slurm's scancel).
    requeue_on_stop: bool = False
    # Flower's basic auth, "user:password"; required when the farm binds a non-loopback host.
    flower_basic_auth: str = ""

    def pool(self, stage: str) -> PoolSettings:
        if stage not in STAGES:
            raise ConfigError(f"unknown stage {stage!r}; expected one of {STAGES}")
        return getattr(self, stage)

    @property
    def visibility_timeout_s(self) -> float:
        """Redis transport visibility timeout: above the longest stage plus generous queue wait.

        An unacked message older than this is redelivered even while its task still runs;
        stage claims make that redelivery a no-op, but it should stay rare.
        """
        return 2 * max(self.pool(s).timeout_s for s in STAGES) + 3600.0


# Read outside Settings: the CLI's farm URL and log level; clients' API token is
# PRORL_API_TOKEN, a setting too.
OTHER_ENV = ("PRORL_URL", "PRORL_LOG_LEVEL", "PRORL_VLLM_PYTHON")


def env_names() -> set[str]:
    """Every PRORL_* variable the farm reads (settings and OTHER_ENV)."""

    class Recorder(dict):
        def get(self, key, default=None):
            seen.add(key)
            return default

    seen: set[str] = set()
    load_settings(Recorder())
    return seen | set(OTHER_ENV)


def _bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


# The range of every numeric setting: (lowest, highest), both allowed. A value outside its
# range (or NaN, or infinite) stops start-up with the variable's name.
DAY_S = 24 * 3600.0
RANGES: dict[str, tuple[float, float]] = {
    "API_PORT": (1, 65535), "FLOWER_PORT": (1, 65535),
    "API_WORKERS": (1, 256), "API_THREADS": (1, 4096),
    "RESULT_TTL_S": (60, 365 * DAY_S),
    "HEARTBEAT_INTERVAL_S": (0.01, 60), "HEARTBEAT_STALE_S": (0.1, 3600),
    "REAP_INTERVAL_S": (0.05, 600), "WATCHDOG_S": (0, DAY_S),
    "MAX_REQUEUES": (0, 100),
    "MAX_BODY_BYTES": (1024, 1 << 34), "MAX_JOBS_PER_REQUEST": (1, 1_000_000),
    "MAX_WAIT_S": (0, 3600),
    "LLM_REQUEST_TIMEOUT_S": (0.1, DAY_S), "LLM_RETRIES": (0, 100),
    "LLM_DRAIN_WAIT_S": (0, DAY_S), "WEIGHTS_TOLERANCE": (1e-9, 100),
    "LLM_MAX_FAILOVERS": (0, 100),
    "GRADE_TIMEOUT_S": (0.1, 3600), "GRADE_MEMORY_MB": (256, 1 << 20),
    "SANDBOX_MAX": (1, 65_000),
    "CONCURRENCY": (1, 10_000), "PREFETCH": (1, 1000), "TIMEOUT_S": (1, 30 * DAY_S),
}
SANDBOX_RUNTIMES = ("auto", "local", "bwrap", "apptainer", "docker")


def _env(environ, name: str, cast, default, range_key: str | None = None):
    raw = environ.get(f"PRORL_{name}")
    if raw is None or raw == "":
        return default
    try:
        value = cast(raw)
    except ValueError as e:
        raise ConfigError(f"PRORL_{name}={raw!r}: not a valid {cast.__name__}") from e
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = RANGES.get(range_key or name, (0, float("inf")))
        if not math.isfinite(value) or not lo <= value <= hi:
            raise ConfigError(f"PRORL_{name}={raw!r}: must be a number from {lo:g} to {hi:g}")
    return value


def _pool_from_env(environ, stage: str, base: PoolSettings) -> PoolSettings:
    up = stage.upper()
    pool = _env(environ, f"{up}_POOL", str, base.pool)
    if pool not in POOL_TYPES:
        raise ConfigError(f"PRORL_{up}_POOL={pool!r}: expected one of {POOL_TYPES}")
    return PoolSettings(
        pool=pool,
        concurrency=_env(environ, f"{up}_CONCURRENCY", int, base.concurrency, "CONCURRENCY"),
        prefetch_multiplier=_env(environ, f"{up}_PREFETCH", int, base.prefetch_multiplier,
                                 "PREFETCH"),
        timeout_s=_env(environ, f"{up}_TIMEOUT_S", float, base.timeout_s, "TIMEOUT_S"),
    )


def load_settings(environ=None, **overrides) -> Settings:
    """Defaults, then PRORL_* environment variables, then explicit overrides."""
    environ = os.environ if environ is None else environ
    d = Settings()
    values = dict(
        redis_url=_env(environ, "REDIS_URL", str, None),
        node=_env(environ, "NODE", str, d.node),
        home=_env(environ, "HOME", str, d.home),
        api_host=_env(environ, "API_HOST", str, d.api_host),
        api_port=_env(environ, "API_PORT", int, d.api_port),
        api_workers=_env(environ, "API_WORKERS", int, d.api_workers),
        api_threads=_env(environ, "API_THREADS", int, d.api_threads),
        flower_port=_env(environ, "FLOWER_PORT", int, d.flower_port),
        result_ttl_s=_env(environ, "RESULT_TTL_S", float, d.result_ttl_s),
        heartbeat_interval_s=_env(environ, "HEARTBEAT_INTERVAL_S", float, d.heartbeat_interval_s),
        heartbeat_stale_s=_env(environ, "HEARTBEAT_STALE_S", float, d.heartbeat_stale_s),
        presence_grace_s=_env(environ, "PRESENCE_GRACE_S", float, d.presence_grace_s),
        presence=_env(environ, "PRESENCE", _bool, d.presence),
        watchdog_s=_env(environ, "WATCHDOG_S", float, d.watchdog_s),
        reap_interval_s=_env(environ, "REAP_INTERVAL_S", float, d.reap_interval_s),
        max_requeues=_env(environ, "MAX_REQUEUES", int, d.max_requeues),
        max_body_bytes=_env(environ, "MAX_BODY_BYTES", int, d.max_body_bytes),
        max_jobs_per_request=_env(environ, "MAX_JOBS_PER_REQUEST", int, d.max_jobs_per_request),
        max_wait_s=_env(environ, "MAX_WAIT_S", float, d.max_wait_s),
        handlers=_env(environ, "HANDLERS", str, d.handlers),
        api_token=_env(environ, "API_TOKEN", str, d.api_token),
        api_read_auth=_env(environ, "API_READ_AUTH", _bool, d.api_read_auth),
        backend_allow=_env(environ, "BACKEND_ALLOW", str, d.backend_allow),
        sandbox_network=_env(environ, "SANDBOX_NETWORK", _bool, d.sandbox_network),
        flower_basic_auth=_env(environ, "FLOWER_BASIC_AUTH", str, d.flower_basic_auth),
        requeue_on_stop=_env(environ, "REQUEUE_ON_STOP", _bool, d.requeue_on_stop),
        task_events=_env(environ, "TASK_EVENTS", _bool, d.task_events),
        llm_request_timeout_s=_env(environ, "LLM_REQUEST_TIMEOUT_S", float,
                                   d.llm_request_timeout_s),
        llm_retries=_env(environ, "LLM_RETRIES", int, d.llm_retries),
        llm_max_failovers=_env(environ, "LLM_MAX_FAILOVERS", int, d.llm_max_failovers),
        llm_drain_wait_s=_env(environ, "LLM_DRAIN_WAIT_S", float, d.llm_drain_wait_s),
        backend_audit=_env(environ, "BACKEND_AUDIT", _bool, d.backend_audit),
        weights_tolerance=_env(environ, "WEIGHTS_TOLERANCE", float, d.weights_tolerance),
        grade_timeout_s=_env(environ, "GRADE_TIMEOUT_S", float, d.grade_timeout_s),
        grade_memory_mb=_env(environ, "GRADE_MEMORY_MB", int, d.grade_memory_mb),
        sandbox_runtime=_env(environ, "SANDBOX_RUNTIME", str, d.sandbox_runtime),
        sandbox_dir=_env(environ, "SANDBOX_DIR", str, d.sandbox_dir),
        sandbox_max=_env(environ, "SANDBOX_MAX", int, d.sandbox_max),
        sandbox_user=_env(environ, "SANDBOX_USER", str, d.sandbox_user),
        sandbox_python=_env(environ, "SANDBOX_PYTHON", str, d.sandbox_python),
        sandbox_ro_paths=_env(environ, "SANDBOX_RO_PATHS", str, d.sandbox_ro_paths),
        sandbox_mount_roots=_env(environ, "SANDBOX_MOUNT_ROOTS", str, d.sandbox_mount_roots),
    )
    for stage in STAGES:
        values[stage] = _pool_from_env(environ, stage, getattr(d, stage))
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", values["node"]):
        raise ConfigError(f"PRORL_NODE={values['node']!r}: 1-64 characters from A-Z a-z 0-9 "
                          "_ - (no '.' or ':')")
    if values["sandbox_runtime"] not in SANDBOX_RUNTIMES:
        raise ConfigError(f"PRORL_SANDBOX_RUNTIME={values['sandbox_runtime']!r}: expected one "
                          f"of {SANDBOX_RUNTIMES}")
    if values["heartbeat_stale_s"] < 3 * values["heartbeat_interval_s"]:
        raise ConfigError(
            f"PRORL_HEARTBEAT_STALE_S={values['heartbeat_stale_s']:g} must be at least 3 x "
            f"PRORL_HEARTBEAT_INTERVAL_S={values['heartbeat_interval_s']:g}: a live worker "
            "would be taken for dead")
    if not (2 * values["heartbeat_interval_s"] <= values["presence_grace_s"]
            <= values["heartbeat_stale_s"]):
        raise ConfigError(
            f"PRORL_PRESENCE_GRACE_S={values['presence_grace_s']:g} must lie between 2 x "
            f"PRORL_HEARTBEAT_INTERVAL_S={values['heartbeat_interval_s']:g} (a live worker "
            "reconnects within a tick) and PRORL_HEARTBEAT_STALE_S="
            f"{values['heartbeat_stale_s']:g}")
    if 0 < values["watchdog_s"] < 3 * values["heartbeat_interval_s"]:
        raise ConfigError(
            f"PRORL_WATCHDOG_S={values['watchdog_s']:g} must be 0 (off) or at least 3 x "
            f"PRORL_HEARTBEAT_INTERVAL_S={values['heartbeat_interval_s']:g}: a live pool "
            "would be killed")
    if values["flower_basic_auth"] and ":" not in values["flower_basic_auth"]:
        raise ConfigError("PRORL_FLOWER_BASIC_AUTH: expected user:password")
    from prorl_farm.access import parse_allow_list

    parse_allow_list(values["backend_allow"])  # a bad entry stops start-up with its name
    values.update(overrides)
    return dataclasses.replace(d, **values)
