"""Every setting of the farm, declared once.

A setting is a field of :class:`Settings` (or, for each stage's pool, of
:class:`PoolSettings`) made with :func:`setting`: its default, its range or choices and one
line of documentation. From these declarations follow loading from ``PRORL_*`` environment
variables (:func:`load_settings`, :func:`read`), validation, the table ``prorl-farm
settings`` prints and docs/configuration.md carries, and the checks of the compose and Slurm files
(``tests/test_deploy.py``). Nothing else in the farm reads a ``PRORL_*`` variable.

Every duration is in seconds and says so in its name (``*_s``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from prorl_farm.errors import ConfigError

STAGES = ("init", "run", "eval")
POOL_TYPES = ("threads", "prefork", "solo", "gevent", "eventlet")
SANDBOX_RUNTIMES = ("auto", "local", "bwrap", "apptainer", "docker")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DAY_S = 24 * 3600.0
NODE_PATTERN = r"[A-Za-z0-9_-]{1,64}"


def setting(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None,
            choices: tuple[str, ...] | None = None, pattern: str | None = None,
            cast: type | None = None, shown: str | None = None, env: str | None = None,
            factory=None):
    """One setting: ``default``, ``doc`` (a line for the table), and what a value may be.

    ``lo``/``hi``: the range of a number, both ends allowed (every number has one);
    ``choices``/``pattern``: what a string may be; ``cast``: the type where the default
    does not say it (None); ``shown``: the default as the table shows it; ``env``: the
    variable's name where it is not ``PRORL_`` + the field's name in capitals (a stage's
    pool fields: the suffix after ``PRORL_<STAGE>_``).
    """
    cast = cast or type(default)
    if cast in (int, float) and (lo is None or hi is None):
        raise TypeError(f"a numeric setting needs its range: {doc!r}")
    meta = dict(doc=doc, lo=lo, hi=hi, choices=choices, pattern=pattern, cast=cast,
                shown=shown, env=env)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@functools.cache
def memory_mb() -> int:
    """The node's memory (MemTotal), in MiB (read once: every grade asks for it)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f
                        if line.startswith("MemTotal:")) // 1024
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0] or "localhost"


@dataclass(frozen=True)
class PoolSettings:
    """How one stage's worker pool runs (``PRORL_<STAGE>_*``)."""

    pool: str = setting("threads", "Celery pool type of each stage", choices=POOL_TYPES,
                        env="POOL")
    concurrency: int = setting(8, "pool sizes", lo=1, hi=10_000, env="CONCURRENCY")
    prefetch_multiplier: int = setting(1, "Celery prefetch multiplier of each pool", lo=1,
                                       hi=1000, env="PREFETCH")
    timeout_s: float = setting(600.0, "stage time limits (enforced by the farm)", lo=1,
                               hi=30 * DAY_S, env="TIMEOUT_S")
    processes: int = setting(
        1, "pool processes of each stage on a node (`up`, the Slurm worker script): a RUN "
        "process serves its harness jobs' model gateways in one Python process, so a node "
        "with many harness jobs in flight runs several to use its cores", lo=1, hi=256,
        env="PROCESSES")


STAGE_DEFAULTS = {
    "init": PoolSettings(concurrency=8, timeout_s=600.0),
    "run": PoolSettings(concurrency=64, timeout_s=3600.0),
    "eval": PoolSettings(concurrency=8, timeout_s=600.0),
}


def _stage(name: str):
    return field(default=STAGE_DEFAULTS[name], metadata=dict(stage=True))


@dataclass(frozen=True)
class Settings:
    """Farm-wide settings; build with :func:`load_settings`."""

    redis_url: str | None = setting(
        None, "Redis to use: `redis://host:port/db`, or a Sentinel service as "
        "`redis+sentinel://host:26379,host:26379/SERVICE/DB` (docs/architecture.md); unset: "
        "`up` starts a private one", cast=str, shown="unset")
    redis_ha: bool = setting(
        False, "`up` (with no PRORL_REDIS_URL) starts a primary, a replica and three "
        "sentinels on loopback instead of one redis-server, and the farm follows a failover")
    redis_failover_s: float = setting(
        20.0, "how long a command to a Sentinel service that lost its connection is retried "
        "before it fails (longer than a failover: the sentinels' down-after time and an "
        "election; a single server: 1.5 s)", lo=0.1,
        hi=600)
    redis_appendfsync: str = setting(
        "everysec", "when the Redis that `up` or the Slurm head starts writes its append-only "
        "file to disk: `everysec` (a crash of the machine loses up to the last second of "
        "writes: jobs submitted or finished then) or `always` (before every reply: nothing "
        "acknowledged is lost, every write waits for the disk)",
        choices=("everysec", "always"))
    node: str = setting(
        "", "node name for the node-local `run.<node>` / `eval.<node>` queues",
        pattern=NODE_PATTERN, shown="short hostname", factory=_short_hostname)
    home: str = setting(".prorl", "data and logs of `prorl-farm up`")
    api_host: str = setting("127.0.0.1", "the API's listen address")
    api_port: int = setting(8000, "the API's port", lo=1, hi=65535)
    api_workers: int = setting(2, "gunicorn worker processes of the API", lo=1, hi=256)
    api_threads: int = setting(
        16, "threads per API worker process (that run requests read whole; a tenant's key "
        "holds at most half, a quarter in long-polls)", lo=1, hi=4096)
    flower_port: int = setting(5555, "Flower's port under `prorl-farm up`", lo=1, hi=65535)
    gym_port: int = setting(
        8010, "the NeMo Gym agent server's port (`prorl-farm gym`; `up` starts it on the "
        "API's host; 0: `up` does not)", lo=0, hi=65535)
    gym_resources_server: str = setting(
        "", "NeMo Gym resources servers the Gym agent server runs rows naming no farm task "
        "on, as `gym` jobs: `URL` (every row) or `NAME=URL` (rows whose agent_ref.name is "
        "NAME), comma-separated",
        pattern=r"^([A-Za-z0-9_.-]+=)?https?://[^\s,]+(,([A-Za-z0-9_.-]+=)?https?://[^\s,]+)*$|^$")
    gym_grader: str = setting(
        "", "the farm grader of Gym rows graded by expected_answer alone, with no resources "
        "server (`math`: math-verify; `contains`; empty: such rows are refused)",
        choices=("", "math", "contains"))
    url: str = setting("http://127.0.0.1:8000",
                       "the farm the CLI's `submit`, `watch`, `export`, `validate` talk to")
    log_level: str = setting("INFO", "log level of every farm process", choices=LOG_LEVELS)
    init: PoolSettings = _stage("init")
    run: PoolSettings = _stage("run")
    eval: PoolSettings = _stage("eval")
    result_ttl_s: float = setting(
        7 * DAY_S, "finished jobs, batch counters and result streams expire this long after "
        "their last change", lo=60, hi=365 * DAY_S)
    store_dir: str = setting(
        "", "the trajectory store: one binary file per finished trajectory (a shared "
        "filesystem on a cluster)", shown="`$PRORL_HOME/trajectories`")
    store_min_free_mb: int = setting(
        1024, "free space the trajectory store keeps: below it new trajectories fail "
        "`storage_error` and nothing stored is touched", lo=0, hi=1 << 40)
    heartbeat_interval_s: float = setting(
        0.5, "how often each worker process heartbeats its jobs and checks for aborts",
        lo=0.01, hi=60)
    heartbeat_stale_s: float = setting(
        30.0, "the heartbeat age at which the reaper declares a job's worker dead (at least "
        "3 x the interval)", lo=0.1, hi=3600)
    presence_grace_s: float = setting(
        1.5, "a worker process whose own Redis connection is gone has its jobs recovered once "
        "their heartbeat is this old", lo=0.02, hi=3600)
    presence: bool = setting(
        True, "tell dead workers by their Redis connection; 0 where Redis's client list says "
        "nothing of them (a proxy in front of Redis, CLIENT disabled)")
    watchdog_s: float = setting(
        60.0, "a pool whose liveness thread stops turning this long while its process lives "
        "(wedged in a C call) is killed for its supervisor to restart; 0 = off",
        lo=0, hi=DAY_S)
    reap_interval_s: float = setting(
        1.0, "how often the reaper sweeps (one pool process at a time)", lo=0.05, hi=600)
    max_requeues: int = setting(
        1, "times a job whose worker died starts again at INIT before failing `worker_lost`",
        lo=0, hi=100)
    max_body_bytes: int = setting(16 * 1024 * 1024, "the largest request body the API takes",
                                  lo=1024, hi=1 << 34, shown="16 MiB")
    max_jobs_per_request: int = setting(10_000, "the most jobs one submit may create", lo=1,
                                        hi=1_000_000)
    max_wait_s: float = setting(60.0, "the longest long-poll (`wait=`) of the API", lo=0,
                                hi=3600)
    task_events: bool = setting(
        False, "Celery task events, for Flower's task views (3 extra publishes per stage; "
        "`prorl-farm up` turns them on)", shown="0 (1 under `prorl-farm up`)")
    llm_request_timeout_s: float = setting(600.0, "timeout of one LLM request", lo=0.1,
                                           hi=DAY_S)
    llm_retries: int = setting(2, "retries of an LLM request on one backend", lo=0, hi=100)
    llm_max_failovers: int = setting(1, "moves to another backend per job", lo=0, hi=100)
    llm_drain_wait_s: float = setting(
        600.0, "how long a job that finds every backend drained (a weight sync) waits for a "
        "resume, within its deadline", lo=0, hi=DAY_S)
    backend_audit: bool = setting(False, "log every acquire's heap snapshot (debugging the "
                                  "balancer)")
    weights_tolerance: float = setting(
        1e-2, "the largest logprob error a weight sync's check accepts (float32 engines agree "
        "within 1e-5, bfloat16 small models within about 5e-3)", lo=1e-9, hi=100)
    vllm_python: str = setting("", "the interpreter of vLLM's environment, for `--engine "
                               "vllm`", shown="`.venv-vllm/bin/python`")
    grade_timeout_s: float = setting(
        10.0, "CPU seconds one `math`/`stem` answer's grading may take (in a helper process at "
        "the lowest priority; 30 times as long of wall clock at most) before it earns 0 with "
        "the reason", lo=0.1, hi=3600)
    grade_memory_mb: int = setting(1024, "memory one answer's grading may take", lo=256,
                                   hi=1 << 20)
    sandbox_runtime: str = setting(
        "auto", "`auto`: `bwrap` where installed, else `local`; or `apptainer`, `docker`",
        choices=SANDBOX_RUNTIMES)
    sandbox_image: str = setting(
        "", "the image of `docker` and `apptainer` sandboxes whose instance names none "
        "(graders' among them)", shown="unset")
    sandbox_dir: str = setting(
        "/tmp/prorl-sandboxes", "sandbox files (keep it short: Unix socket paths are limited "
        "to 107 bytes)")
    sandbox_max: int = setting(64, "live sandboxes per node", lo=1, hi=65_000)
    sandbox_scratch_mb: int = setting(
        64, "size of each memory-backed directory of a sandbox (`/dev/shm`, `/run`; bwrap "
        "and docker; `/tmp` and `/var/tmp` are on disk, counted in the workspace's size): "
        "writing past it fails inside; cut to fit the node's budget (`PRORL_NODE_SCRATCH_MB`)",
        lo=1, hi=1 << 20)
    sandbox_workspace_mb: int = setting(
        4096, "size of a sandbox's workspace as a whole (on the node's disk; RUN's and "
        "graders'): the tool server measures it and kills what writes past it",
        lo=16, hi=1 << 24)
    grade_scratch_mb: int = setting(
        64, "size of the `/dev/shm` (memory) of a grader's jail (`swe`, `code`; its `/tmp` is "
        "on disk, in the grader's workspace): writing past it fails inside; cut to fit the "
        "node's budget (`PRORL_NODE_SCRATCH_MB`)", lo=1, hi=1 << 20)
    node_scratch_mb: int = setting(
        0, "the node's budget of memory-backed scratch: every tmpfs of `PRORL_SANDBOX_MAX` "
        "sandboxes (`/dev/shm`, `/run`, a grader's jail's `/dev/shm`) fits in it, each cut "
        "to a third of its share when the settings above ask more; 0: a quarter of the "
        "node's memory", lo=0, hi=1 << 30, shown="a quarter of the memory")
    sandbox_user: str = setting(
        "auto", "host user a sandbox runs as: `auto` = `nobody` when the farm is root (if "
        "`nobody` can read the farm's installation; else the farm's own, with a warning), "
        "else the farm's own; a name or `uid[:gid]`; never root")
    sandbox_python: str = setting(
        "", "the tool server's interpreter inside (the farm's, or the system's python3 of "
        "the same version where the sandbox user cannot run the farm's)", shown="the farm's")
    sandbox_ro_paths: str = setting("", "read-only paths in every sandbox, `host[:inside],...`")
    sandbox_mount_roots: str = setting(
        "", "host roots under which handlers and instances may ask for more read-only paths, "
        "comma-separated; SWE repositories are looked for under each in this order (the "
        "first that holds an instance's commits is used)")
    swe_env_dir: str = setting(
        "/var/tmp/prorl-swe-envs", "environments of real SWE instances (one per repository "
        "and version, built once, read-only in sandboxes) and their unpacked repositories; "
        "readable by the sandbox user")
    swe_locks: str = setting(
        "", "a directory of SWE environment locks (`prorl-farm swebench lock` writes them), "
        "used before the package's own", shown="none: the package's")
    swe_pythons: str = setting(
        "", "interpreters for SWE environments, `3.9=/path/python3.9,...`",
        shown="pyenv's newest build of each version")
    harness_dir: str = setting(
        "", "agent harness environments (`prorl-farm harness install`), read-only at "
        "/opt/harnesses in a sandbox that runs a harness", shown="`$PRORL_HOME/harnesses`")
    npm_cache: str = setting(
        "", "where `prorl-farm harness install` keeps the npm tarballs of the CLI presets "
        "(Claude Code, Codex; checked against their pinned integrity before use)",
        shown="`~/.cache/prorl-farm/npm`")
    sandbox_network: bool = setting(
        False, "whether an instance may ask for a sandbox with the outside network")
    handlers: str = setting("", "extra handlers without packaging, `name=module:Class,...`")
    api_token: str = setting(
        "", "Bearer token for every mutating API call (clients send it too)", shown="unset")
    api_denials_per_min: int = setting(
        120, "refusals for want of a key or of a visible id (401, 404) a client address may "
        "have within a minute before it is answered 429 (keys configured only); 0: no "
        "limit", lo=0, hi=1 << 30)
    backend_allow: str = setting(
        "", "hosts and CIDRs (besides loopback) whose URLs may be registered as LLM backends "
        "or named as Gym resources servers (`gym` jobs)",
        shown="loopback only")
    tenant_loopback: bool = setting(
        False, "tenants' keys may register LLM backends on this host (loopback, its own "
        "addresses); the operator's key always may (docs/security.md)")
    tenants: str = setting(
        "", "tenants, their API keys, weights and quotas: a JSON object or @FILE "
        "(docs/sharing.md)", shown="one, `default`")
    tenant_cpu: bool = setting(
        True, "the processes a node starts for a tenant's jobs (sandboxes, graders, answer "
        "checking) share the CPU by the tenant's weight: a cgroup per tenant (v1 `cpu."
        "shares`; root only, nothing where it cannot be made: docs/sharing.md)")
    warm_pool: int = setting(
        0, "warm sandboxes each node's INIT pool keeps ready for the jobs about to reach "
        "INIT (a READY stage: the handler's INIT run ahead for their instances; each used "
        "once, then stopped with its job); 0: none", lo=0, hi=10_000)
    warm_ttl_s: float = setting(120.0, "how long a warm sandbox waits for its job before it "
                                "is stopped unused", lo=1, hi=DAY_S)
    warm_scan: int = setting(256, "how many of the next jobs waiting for INIT the warm pool "
                             "reads to size itself per instance", lo=1, hi=100_000)
    warm_builders: int = setting(2, "warm sandboxes each INIT pool builds at once", lo=1,
                                 hi=256)
    warm_graders: bool = setting(
        True, "an EVAL pool keeps its `code` graders warm: a grading sandbox per tenant "
        "serving problem after problem, each program in a fresh jail (no sandbox start per "
        "grading)")
    grader_idle_s: float = setting(5.0, "how long a warm grader waits for its next problem "
                                   "before it is stopped", lo=0.5, hi=DAY_S)
    fair_share: bool = setting(
        True, "weighted fair share of every stage's slots between tenants, then between "
        "each tenant's batches, with priorities (docs/sharing.md); off: each stage first "
        "come, first served")
    fair_reserve: float = setting(
        1.0, "slots each pool keeps in reserve, as a fraction of its concurrency, for tenants "
        "under their share while others hold every shared slot (the pool runs that many "
        "more workers; a tenant alone never uses them)", lo=0.0, hi=4.0)
    fair_aging_s: float = setting(
        60.0, "seconds of head start per priority level in a tenant's queue: a job of "
        "priority p goes before jobs of priority p-1 that came up to this long before it",
        lo=0.001, hi=DAY_S)
    requeue_on_stop: bool = setting(
        False, "on SIGTERM re-queue what the pool holds at once instead of finishing it (nodes "
        "that go away with their sandboxes)", shown="0 (1 in `slurm/`)")
    flower_basic_auth: str = setting(
        "", "Flower's basic auth, `user:password`; required off loopback", shown="unset")

    @property
    def trajectory_dir(self) -> str:
        """The trajectory store's directory, absolute."""
        return os.path.abspath(self.store_dir or os.path.join(self.home, "trajectories"))

    @property
    def harness_path(self) -> str:
        """The harness environments' directory, absolute."""
        return os.path.abspath(self.harness_dir or os.path.join(self.home, "harnesses"))

    def memory_scratch_mb(self) -> tuple[int, int]:
        """The size of each memory-backed directory of a sandbox (/dev/shm, /run) and of a
        grader's jail's /dev/shm, in MiB: the settings', cut so that the three of each of
        ``sandbox_max`` sandboxes fit the node's budget (``node_scratch_mb``; 0: a quarter
        of its memory). A tmpfs takes memory only as it is written; the bound is what it
        may take."""
        budget = self.node_scratch_mb or memory_mb() // 4
        share = max(1, budget // (3 * self.sandbox_max))
        return min(self.sandbox_scratch_mb, share), min(self.grade_scratch_mb, share)

    def reserve_slots(self, stage: str) -> int:
        """Worker slots a pool of ``stage`` runs beyond its concurrency (``fair_reserve``)."""
        if not self.fair_share:
            return 0
        return math.ceil(self.pool(stage).concurrency * self.fair_reserve)

    def farm_listeners(self) -> list[tuple[str, int]]:
        """The farm's own listeners, never a backend: its API, Flower, Gym server, and
        every Redis server and sentinel (redisconn.all_endpoints)."""
        from prorl_farm import redisconn

        ports = [self.api_port, self.flower_port, self.gym_port]
        return [(self.api_host, p) for p in ports if p] + \
            redisconn.all_endpoints(self.redis_url)

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


# Variables of the deployment scripts (compose, Slurm), not of the farm's processes.
DEPLOY_ENV = {
    "PRORL_API_PUBLISH": "compose: the host port the API is published on (8000)",
    "PRORL_FLOWER_PUBLISH": "compose: the host port Flower is published on (5555)",
    "PRORL_GYM_PUBLISH": "compose: the host port the NeMo Gym agent server is published on "
                         "(8010)",
    "PRORL_BASE_IMAGE": "compose: the base the farm's images build on "
                        "(python:3.11-slim-bookworm; deploy/base-image.sh makes one)",
    "PRORL_REDIS_IMAGE": "compose: the Redis image (redis:7-bookworm; deploy/base-image.sh "
                         "makes prorl-redis:bookworm)",
    "PRORL_SHARED": "Slurm: a directory on the shared filesystem (required)",
    "PRORL_FARM_DIR": "Slurm: the project checkout (default: where sbatch ran)",
    "PRORL_PYTHON": "Slurm: the Python with the farm installed (default: the checkout's .venv)",
    "PRORL_LOG_DIR": "Slurm: where logs go (default: $PRORL_SHARED/logs)",
    "PRORL_HEAD_HOST": "Slurm: the name workers reach the head by (default: its host)",
    "PRORL_HEAD_WAIT_S": "Slurm: how long a worker node waits for the head (600)",
    "PRORL_HEAD_JOB": "Slurm: the head's job id, in head.env",
    "PRORL_REDIS_PORT": "Slurm: the head's Redis port (6379)",
    "PRORL_REDIS_DIR": "Slurm: the head's Redis data (default: $PRORL_SHARED/redis)",
    "PRORL_REDIS_PASSWORD": "Slurm: the head's Redis password, in head.env",
    "PRORL_FLOWER_URL": "Slurm: Flower's address, in head.env",
    "PRORL_GYM_URL": "Slurm: the NeMo Gym agent server's address, in head.env (empty: none)",
}


def env_name(f: dataclasses.Field, stage: str | None = None) -> str:
    """The environment variable of a field (of a stage's pool, with ``stage``)."""
    if stage is not None:
        return f"PRORL_{stage.upper()}_{f.metadata['env']}"
    return f.metadata.get("env") or f"PRORL_{f.name.upper()}"


def _declared() -> list[tuple[dataclasses.Field, str | None]]:
    """(field, stage) for every setting; stage is None but for the pools' fields."""
    out: list[tuple[dataclasses.Field, str | None]] = []
    for f in dataclasses.fields(Settings):
        if f.metadata.get("stage"):
            out += [(pf, f.name) for pf in dataclasses.fields(PoolSettings)]
        else:
            out.append((f, None))
    return out


def env_names() -> set[str]:
    """Every PRORL_* variable the farm's processes read."""
    return {env_name(f, stage) for f, stage in _declared()}


def _bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _check(name: str, raw: Any, value: Any, meta) -> None:
    if meta["cast"] in (int, float):
        lo, hi = meta["lo"], meta["hi"]
        if not math.isfinite(value) or not lo <= value <= hi:
            raise ConfigError(f"{name}={raw!r}: must be a number from {lo:g} to {hi:g}")
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{name}={raw!r}: expected one of {meta['choices']}")
    if meta["pattern"] and not re.fullmatch(meta["pattern"], value):
        raise ConfigError(f"{name}={raw!r}: must match {meta['pattern']}")


def _read(environ, f: dataclasses.Field, default: Any, stage: str | None = None) -> Any:
    name = env_name(f, stage)
    raw = environ.get(name)
    if raw is None or raw == "":
        value = default() if callable(default) else default
        if value is not None:
            _check(name, value, value, f.metadata)
        return value
    cast = f.metadata["cast"]
    try:
        value = (_bool if cast is bool else cast)(raw)
    except ValueError as e:
        raise ConfigError(f"{name}={raw!r}: not a valid {cast.__name__}") from e
    _check(name, raw, value, f.metadata)
    return value


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory if f.default is dataclasses.MISSING else f.default


def read(name: str, environ=None) -> Any:
    """One setting from the environment, validated (for a process that needs only it:
    a client's URL and token, the log level)."""
    environ = os.environ if environ is None else environ
    f = next(f for f in dataclasses.fields(Settings) if f.name == name)
    return _read(environ, f, _default(f))


def load_settings(environ=None, **overrides) -> Settings:
    """Defaults, then PRORL_* environment variables, then explicit overrides."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        if f.metadata.get("stage"):
            base = STAGE_DEFAULTS[f.name]
            values[f.name] = PoolSettings(**{
                pf.name: _read(environ, pf, getattr(base, pf.name), f.name)
                for pf in dataclasses.fields(PoolSettings)})
        else:
            values[f.name] = _read(environ, f, _default(f))
    _check_together(values)
    values.update(overrides)
    return Settings(**values)


def _check_together(values: dict) -> None:
    """What one setting's range cannot say: the liveness timings against each other."""
    beat, stale = values["heartbeat_interval_s"], values["heartbeat_stale_s"]
    grace, watchdog = values["presence_grace_s"], values["watchdog_s"]
    if stale < 3 * beat:
        raise ConfigError(
            f"PRORL_HEARTBEAT_STALE_S={stale:g} must be at least 3 x "
            f"PRORL_HEARTBEAT_INTERVAL_S={beat:g}: a live worker would be taken for dead")
    if not 2 * beat <= grace <= stale:
        raise ConfigError(
            f"PRORL_PRESENCE_GRACE_S={grace:g} must lie between 2 x "
            f"PRORL_HEARTBEAT_INTERVAL_S={beat:g} (a live worker reconnects within a tick) "
            f"and PRORL_HEARTBEAT_STALE_S={stale:g}")
    if 0 < watchdog < 3 * beat:
        raise ConfigError(
            f"PRORL_WATCHDOG_S={watchdog:g} must be 0 (off) or at least 3 x "
            f"PRORL_HEARTBEAT_INTERVAL_S={beat:g}: a live pool would be killed")
    if values["redis_url"]:
        from prorl_farm.redisconn import parse

        parse(values["redis_url"])  # a malformed URL stops start-up with what is wrong
    if values["flower_basic_auth"] and ":" not in values["flower_basic_auth"]:
        raise ConfigError("PRORL_FLOWER_BASIC_AUTH: expected user:password")
    from prorl_farm.access import parse_allow_list

    parse_allow_list(values["backend_allow"])  # a bad entry stops start-up with its name
    from prorl_farm.tenants import parse_tenants

    parse_tenants(values["tenants"])


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    if value == "":
        return "empty"
    return f"`{value}`" if isinstance(value, str) else str(value)


def table() -> str:
    """The settings as a Markdown table (``prorl-farm settings``, docs/configuration.md)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    stages = "{" + ",".join(s.upper() for s in STAGES) + "}"
    for f in dataclasses.fields(Settings):
        if f.metadata.get("stage"):
            if f.name != STAGES[0]:
                continue
            for pf in dataclasses.fields(PoolSettings):
                shown = sorted({_shown(getattr(STAGE_DEFAULTS[s], pf.name)) for s in STAGES})
                shown = (" / ".join(_shown(getattr(STAGE_DEFAULTS[s], pf.name))
                                    for s in STAGES) if len(shown) > 1 else shown[0])
                rows.append(f"| `PRORL_{stages}_{pf.metadata['env']}` | {shown} | "
                            f"{pf.metadata['doc']} |")
            continue
        shown = f.metadata["shown"] or _shown(_default(f))
        rows.append(f"| `{env_name(f)}` | {shown} | {f.metadata['doc']} |")
    return "\n".join(rows) + "\n"
