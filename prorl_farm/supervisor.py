"""`prorl-farm up`: run the whole farm on one machine and keep it running.

Starts a private redis-server (unless PRORL_REDIS_URL is set; append-only persistence in
the data directory, so finished results and queued jobs survive a restart), the API under
gunicorn, the INIT/RUN/EVAL pools and Flower; says "is up" only once ``/readyz`` passes;
restarts a part that dies, showing the last lines of its log; on SIGINT/SIGTERM stops every
process it started (each runs in its own process group, and is told to die with the
supervisor should the supervisor itself be killed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import redis

from prorl_farm import keys, redisconn
from prorl_farm.access import is_loopback
from prorl_farm.config import STAGES, Settings
from prorl_farm.errors import FarmError
from prorl_farm.redis_ha import RedisHA, free_port
from prorl_farm.sandbox.process import parent_death_signal
from prorl_farm.tenants import parse_tenants

log = logging.getLogger(__name__)

GRACE_S = 10.0
MAX_BACKOFF_S = 30.0
READY_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 15


class StartupError(FarmError):
    """`up` cannot start: the message says why (the CLI prints it, exit status 1)."""

    def __init__(self, message: str):
        super().__init__(f"prorl-farm up: {message}")


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join("    | " + line for line in text.splitlines()[-lines:])


def _die_with_parent() -> None:
    """Runs in the child before exec: own process group, SIGTERM when the parent dies."""
    os.setsid()
    try:
        parent_death_signal(signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    restart: bool = True
    # Started once the farm is ready (Flower: it asks the workers for their queues when it
    # starts, and shows only those that answered).
    after_ready: bool = False
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    env: dict = field(default_factory=dict)
    umask: int = -1  # the child's file mode mask (-1: the supervisor's own)

    def start(self, base_env: dict) -> None:
        logf = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - owned by the child
        try:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                env={**base_env, **self.env}, preexec_fn=_die_with_parent, umask=self.umask,
            )
        finally:
            logf.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def group_empty(self) -> bool:
        if self.proc is None:
            return True
        self.proc.poll()
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return True
        return False


def wait_for_redis(url: str, timeout_s: float = 15.0) -> None:
    client = redisconn.client(url)
    end = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.exceptions.ConnectionError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)
        finally:
            client.close()


def with_credentials(settings: Settings, auth: bool) -> tuple[Settings, list[str]]:
    """The settings `up` runs with, and which credentials it made up: off loopback the API
    needs a token and Flower a password, made up if not given. With tenants' keys, the
    operator's token too (the farm's own surfaces are its: api/access.py), and Flower, whose
    pages show every tenant's tasks, is behind it."""
    exposed = not is_loopback(settings.api_host)
    keyed = any(t.token_sha256 for t in parse_tenants(settings.tenants).values())
    generated: list[str] = []
    if (auth or exposed or keyed) and not settings.api_token:
        settings = dataclasses.replace(settings, api_token=secrets.token_urlsafe(24))
        generated.append("api_token")
    if (exposed or keyed) and not settings.flower_basic_auth:
        settings = dataclasses.replace(
            settings, flower_basic_auth=f"operator:{settings.api_token}" if keyed
            else f"prorl:{secrets.token_urlsafe(16)}")
        generated.append("flower_basic_auth")
    return settings, generated


def reap(children: list[Child]) -> None:
    """Wait for the groups of ``children`` (told to stop) to empty; SIGKILL what is left
    after the grace period."""
    end = time.monotonic() + GRACE_S
    while time.monotonic() < end and not all(c.group_empty() for c in children):
        time.sleep(0.1)
    for child in children:
        if not child.group_empty():
            child.signal_group(signal.SIGKILL)
        if child.proc is not None:
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) did not exit after SIGKILL", child.name, child.proc.pid)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (0600) from the first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def _private_dir(path: Path) -> None:
    """``path`` as a directory of its owner's only (0700), the files an earlier run left in
    it (append-only files, config files) 0600."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    for entry in path.rglob("*"):
        entry.chmod(0o700 if entry.is_dir() else 0o600)


class PrivateRedis:
    """The farm's own Redis under `up` (no PRORL_REDIS_URL): one redis-server, or with
    PRORL_REDIS_HA a primary, a replica and three sentinels, its data under the home."""

    def __init__(self, settings: Settings, home: Path, logs: Path):
        self.settings, self.home, self.logs = settings, home, logs
        self.children: list[Child] = []
        self.ha: RedisHA | None = None

    def start(self) -> str:
        """Start it; its URL once it answers."""
        if self.settings.redis_ha:
            return self._start_ha()
        if not shutil.which("redis-server"):
            raise SystemExit("redis-server not found: install it (apt-get install redis-server) "
                             "or set PRORL_REDIS_URL")
        data = self.home / "redis"
        _private_dir(data)
        port = free_port()
        # Append-only file, fsync every second (or every write: PRORL_REDIS_APPENDFSYNC):
        # finished results (kept result_ttl_s), queued jobs and the dashboard's history
        # survive a restart of `up`. The port changes; the data does not. The farm's alone:
        # a password (made once, kept 0600 under the home) in a config file no command line
        # shows, its files 0600 in a 0700 directory (docs/security.md).
        password = self._password()
        conf = data / "redis.conf"
        _write_private(conf, "\n".join([
            f"port {port}", "bind 127.0.0.1", f"dir {data}", "appendonly yes",
            f"appendfsync {self.settings.redis_appendfsync}", 'save ""',
            f"hash-max-listpack-value {keys.HASH_MAX_LISTPACK_VALUE}", "daemonize no",
            f"requirepass {password}"]) + "\n")
        self.children = [Child("redis", ["redis-server", str(conf)], self.logs / "redis.log",
                               restart=False, umask=0o077)]
        self.children[0].start(dict(os.environ))
        url = f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0"
        try:
            wait_for_redis(url, timeout_s=60)  # loading a large append-only file takes a while
        except redis.exceptions.ConnectionError:
            raise StartupError("the private redis-server did not start:\n"
                               + log_tail(self.logs / "redis.log")) from None
        return url

    def _password(self) -> str:
        """The private Redis's password: made up once, kept in ``<home>/redis-password``
        (0600), the same for every `up` (the HA trio's config files hold it)."""
        path = self.home / "redis-password"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            secret = secrets.token_urlsafe(32)
            _write_private(path, secret + "\n")
            return secret

    def _start_ha(self) -> str:
        """A primary, a replica and three sentinels (redis_ha.py), restarted when one exits
        (a primary that comes back rejoins as a replica): the farm follows a failover."""
        _private_dir(self.home / "redis-ha")
        ha = self.ha = RedisHA(self.home / "redis-ha", appendfsync=self.settings.redis_appendfsync,
                               password=self._password())
        self.children = [Child(m.name, m.argv, m.log, restart=True, umask=0o077)
                         for m in ha.members()]
        for child in self.children:
            child.start(dict(os.environ))
        try:
            ha.wait_ready(60)
        except TimeoutError as e:
            raise StartupError(f"{e}:\n" + "\n".join(
                f"{c.name}:\n{log_tail(c.log_path)}" for c in self.children)) from None
        return ha.url

    def gone(self) -> bool:
        """Whether it ran and is gone for good (a single server is not restarted)."""
        return bool(self.children) and not any(c.restart or c.alive() for c in self.children)

    def held_back(self, child: Child) -> bool:
        """Whether ``child`` is the HA trio's dead primary that the sentinels have not yet
        replaced: started again before the failover, it would come back as the primary
        from its own append-only file (without its last second, with everysec) and its
        replica would copy that, losing what the replica held. Once a replica is promoted,
        it comes back as a replica of the new primary."""
        if self.ha is None or not child.name.startswith("redis-"):
            return False
        return self.ha.primary() == child.name.removeprefix("redis-")

    def described(self) -> str:
        return (f"   (private{', HA' if len(self.children) > 1 else ''})"
                if self.children else "")

    def stop(self) -> None:
        for child in self.children:
            child.signal_group(signal.SIGTERM)
        reap(self.children)
        self.children = []


class ModelServer:
    """The local model `up --model` serves on the CPU (the dev server or vLLM's CPU build)
    and registers as a backend while the farm is up."""

    def __init__(self, path: str, engine: str, logprobs_mode: str, logs: Path):
        from prorl_farm.dev.engines import choose

        self.path = str(Path(path).resolve())
        self.port = free_port()
        self.logprobs_mode = logprobs_mode  # what the model server returns, and says so
        self.engine, _, self.engine_line = choose(engine)
        print(self.engine_line, flush=True)
        self.logs = logs
        self.backend_id: str | None = None
        self._registry = None

    def child(self, cli: list[str]) -> Child:
        return Child("dev-model", cli + ["serve-model", "--model", self.path,
                                         "--port", str(self.port), "--engine", self.engine,
                                         "--logprobs-mode", self.logprobs_mode],
                     self.logs / "dev-model.log")

    def register(self, redis_url: str, stopping: Callable[[], bool]) -> None:
        """Once it answers /health, register it as a backend."""
        from prorl_farm.llm.registry import BackendRegistry, BackendSpec, context_length

        base = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + (600 if self.engine == "vllm" else 120)
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > end or stopping():
                raise SystemExit(f"dev model did not come up; see {self.logs}/dev-model.log")
            time.sleep(0.2)
        registry = BackendRegistry(redisconn.client(redis_url, decode_responses=True))
        name = Path(self.path).name
        self.backend_id = registry.register(BackendSpec(
            url=base, kind="vllm", model=name, tokenizer=self.path,
            capacity=4, logprobs_mode=self.logprobs_mode,
            max_model_len=context_length(base, name) or 0))
        self._registry = registry

    def unregister(self) -> None:
        if self.backend_id is None:
            return
        try:
            self._registry.unregister(self.backend_id)
        except Exception:
            log.warning("could not unregister the dev model backend", exc_info=True)
        self.backend_id = None

    def described(self) -> str:
        return (f"  model   {self.path} on http://127.0.0.1:{self.port} "
                f"(backend {self.backend_id}; {self.engine_line})")


class Supervisor:
    """`up`: the farm's processes (pools, API, Flower, the Gym agent server, a model server)
    started in order, kept running, and stopped; its Redis (:class:`PrivateRedis`) and its
    model (:class:`ModelServer`) are parts of their own."""

    def __init__(self, settings: Settings, dev_model: str | None = None, auth: bool = False,
                 engine: str = "dev", logprobs_mode: str = "raw_logprobs"):
        self.settings, self.generated = with_credentials(settings, auth)
        self.home = Path(self.settings.home).resolve()
        self.logs = self.home / "logs"
        self.model = (ModelServer(dev_model, engine, logprobs_mode, self.logs) if dev_model
                      else None)
        self.children: list[Child] = []
        self.redis = PrivateRedis(self.settings, self.home, self.logs)
        self._stopping = False
        self._made_sandbox_dir = False  # `up` made PRORL_SANDBOX_DIR: it removes it at stop

    def _python(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def _plan(self) -> None:
        s = self.settings
        cli = self._python("-m", "prorl_farm.cli")
        self.children = []
        for st in STAGES:
            n = s.pool(st).processes
            self.children += [Child(f"worker-{st}" + (f"-{i}" if n > 1 else ""),
                                    cli + ["worker", st],
                                    self.logs / (f"{st}-{i}.log" if n > 1 else f"{st}.log"))
                              for i in range(n)]
        self.children.append(Child("api", cli + ["api"], self.logs / "api.log"))
        if s.gym_port:
            host = "127.0.0.1" if s.api_host in ("0.0.0.0", "::") else s.api_host
            self.children.append(Child(
                "gym", cli + ["gym", "--port", str(s.gym_port), "--farm",
                              f"http://{host}:{s.api_port}"],
                self.logs / "gym.log", after_ready=True))
        # Flower's control API (revoke, shut down workers, resize pools) is unauthenticated
        # only on loopback; elsewhere Flower, API included, is behind basic auth.
        flower_env = ({"FLOWER_BASIC_AUTH": s.flower_basic_auth} if s.flower_basic_auth
                      else {"FLOWER_UNAUTHENTICATED_API": "1"})
        self.children.append(Child(
            "flower",
            # Its broker is the app's (PRORL_REDIS_URL, in its environment): no password on
            # a command line.
            self._python("-m", "celery", "-A", "prorl_farm.celery_app", "flower",
                         f"--port={s.flower_port}", f"--address={s.api_host}"),
            self.logs / "flower.log", env=flower_env, after_ready=True))
        if self.model:
            self.children.append(self.model.child(cli))

    def _lock_home(self) -> None:
        """One `up` per data directory: two private Redis servers must never share it."""
        import fcntl

        self._lock_file = open(self.home / "up.lock", "a+")  # noqa: SIM115 - held while up
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.seek(0)
            other = self._lock_file.read().strip() or "?"
            raise StartupError(f"another prorl-farm up (pid {other}) runs with the data "
                               f"directory {self.home}; stop it, or set PRORL_HOME") from None
        self._lock_file.truncate(0)
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()

    def _check_ports(self) -> None:
        s = self.settings
        busy = [f"{name} port {port} ({var})" for name, port, var in (
            ("API", s.api_port, "PRORL_API_PORT"), ("Flower", s.flower_port, "PRORL_FLOWER_PORT"),
            ("Gym", s.gym_port, "PRORL_GYM_PORT"))
            if port and not port_free(s.api_host, port)]
        if busy:
            raise StartupError(
                f"{' and '.join(busy)} on {s.api_host} already in use: is another farm up? "
                "Stop it, or choose other ports, e.g. PRORL_API_PORT=8001 PRORL_FLOWER_PORT=5556 "
                "PRORL_GYM_PORT=8011")

    def _wait_ready(self) -> None:
        """Wait until the API answers /readyz (Redis reachable, a live pool per stage)."""
        url = f"http://{self.settings.api_host}:{self.settings.api_port}/readyz"
        end = time.monotonic() + READY_TIMEOUT_S
        while not self._stopping:
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            for child in self.children:
                if (child.proc is not None and not child.alive() and child.restarts == 0
                        and child.name != "dev-model"):
                    self._report_exit(child)
                    raise StartupError(f"{child.name} exited while starting (see above)")
            if time.monotonic() > end:
                raise StartupError(f"not ready after {READY_TIMEOUT_S:g} s; logs in {self.logs}/")
            time.sleep(0.2)

    def _wait_port(self, port: int, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not self._stopping:
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((self.settings.api_host, port)) == 0:
                    return
            time.sleep(0.2)

    @staticmethod
    def _report_exit(child: Child) -> None:
        code = child.proc.returncode if child.proc else None
        print(f"{child.name} exited ({code}); last lines of {child.log_path}:\n"
              + log_tail(child.log_path), file=sys.stderr, flush=True)

    def run(self) -> int:
        self.logs.mkdir(parents=True, exist_ok=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self._lock_home()
            self._made_sandbox_dir = not Path(self.settings.sandbox_dir).exists()
            self._check_ports()
            print(f"starting prorl-farm (logs in {self.logs}/) ...", flush=True)
            url = self.settings.redis_url or self.redis.start()
            # Flower runs here, so the pools send task events unless told otherwise.
            env = dict(os.environ, PRORL_REDIS_URL=url)
            env.setdefault("PRORL_TASK_EVENTS", "1")
            if self.settings.api_token:
                env["PRORL_API_TOKEN"] = self.settings.api_token
                self._write_secret("api-token", self.settings.api_token)
            self._plan()
            for child in self.children:
                if not child.after_ready:
                    child.start(env)
            if self.model:
                self.model.register(url, lambda: self._stopping)
            self._wait_ready()
            if self._stopping:
                return 0
            for child in self.children:
                if child.after_ready:
                    child.start(env)
            self._wait_port(self.settings.flower_port, 30.0)
            self._announce(url)
            return self._monitor(env)
        finally:
            self.stop()

    def _write_secret(self, name: str, value: str) -> None:
        _write_private(self.home / name, value + "\n")

    def _announce(self, url: str) -> None:
        s = self.settings
        lines = [
            "prorl-farm is up",
            f"  API     http://{s.api_host}:{s.api_port}   (dashboard at /; /metrics, "
            "/openapi.json)",
            f"  Flower  http://{s.api_host}:{s.flower_port}",
            *([f"  Gym     http://{s.api_host}:{s.gym_port}   (NeMo Gym agent server: /run)"]
              if s.gym_port else []),
            f"  Redis   {redisconn.parse(url).shown()}{self.redis.described()}",
            "  pools   " + ", ".join(f"{st}: {s.pool(st).pool} x{s.pool(st).concurrency}"
                                      for st in STAGES),
            f"  node    {s.node}",
        ]
        if s.api_token:
            lines.append(f"  token   {s.api_token}   (Authorization: Bearer; also in "
                         f"{self.home / 'api-token'}; clients read PRORL_API_TOKEN)"
                         if "api_token" in self.generated else
                         "  token   from PRORL_API_TOKEN (every call needs it)")
        if "flower_basic_auth" in self.generated:
            lines.append(f"  Flower login  {s.flower_basic_auth}")
        if self.model:
            lines.append(self.model.described())
        lines += [f"  logs    {self.logs}/", "Ctrl-C stops everything."]
        print("\n".join(lines), flush=True)

    def _on_signal(self, signum, _frame) -> None:
        self._stopping = True

    def _monitor(self, env: dict) -> int:
        while not self._stopping:
            if self.redis.gone():
                log.error("private redis-server exited; stopping the farm")
                print("redis-server exited; stopping", file=sys.stderr, flush=True)
                return 1
            now = time.monotonic()
            for child in self.redis.children + self.children:
                if child.alive() or not child.restart or self.redis.held_back(child):
                    continue
                if child.next_start == 0.0:
                    backoff = min(MAX_BACKOFF_S, 2.0 ** min(child.restarts, 5))
                    child.next_start = now + (0.5 if child.restarts == 0 else backoff)
                    self._report_exit(child)
                    print(f"restarting {child.name}", file=sys.stderr, flush=True)
                elif now >= child.next_start:
                    child.signal_group(signal.SIGKILL)  # leftovers of the dead process group
                    child.restarts += 1
                    child.next_start = 0.0
                    child.start(env)
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        """Stop every child: SIGTERM its group, SIGKILL what is left after the grace period."""
        if self.model:
            self.model.unregister()
        groups = [c for c in self.children if c.proc is not None]
        for child in groups:
            child.signal_group(signal.SIGTERM)
        reap(groups)
        self.redis.stop()
        self.children = []
        self._remove_sandbox_dir()

    def _remove_sandbox_dir(self) -> None:
        """The sandbox directory, when `up` made it, once its pools are gone: removed if it
        holds no sandbox (only the runtime's own files, such as ``.etc``); a sandbox a
        killed pool left is kept, and said (the next pool on the node reaps it)."""
        root = Path(self.settings.sandbox_dir)
        if not self._made_sandbox_dir or not root.is_dir():
            return
        left = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        if left:
            log.warning("%s still holds %d sandboxes (%s): kept", root, len(left),
                        ", ".join(left[:5]))
            return
        shutil.rmtree(root, ignore_errors=True)
        self._made_sandbox_dir = False
