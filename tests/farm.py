"""Test helpers: a real redis-server and real worker pool processes."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import redis

from prorl_farm import redisconn
from prorl_farm.keys import HASH_MAX_LISTPACK_VALUE

ROOT = Path(__file__).resolve().parent.parent


def kept(name: str) -> Path | None:
    """A directory the suite keeps between runs, as a CI keeps its caches: built things keyed
    by what they are built from (the Docker engine's images and layers, SWE environments), so
    that a run rebuilds only what changed. ``PRORL_TEST_CACHE`` (default
    ``/var/cache/prorl-farm/tests`` for root, which the pools' other users can read,
    ``~/.cache/prorl-farm/tests`` for others); set it empty to build everything anew in every
    run, as on a fresh machine (None then)."""
    home = Path("/var/cache") if os.geteuid() == 0 else \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    value = os.environ.get("PRORL_TEST_CACHE", str(home / "prorl-farm" / "tests"))
    return Path(value) / name if value else None
STAGES = ("init", "run", "eval")


def sandbox_root(name: str) -> str:
    """Where a test farm's sandboxes live (short: Unix socket paths are limited): in memory
    (``/dev/shm``) where the node has it. On this kind of node the disk takes seconds to
    create a checkout of thousands of files (a Django tree: 6,600 files, about 7 s) that
    memory takes a tenth of a second for; the farm's own default is an operator's choice
    (``PRORL_SANDBOX_DIR``), and what a sandbox writes is bounded either way."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else "/tmp"
    return f"{base}/prs-{name}"


# Sandboxes of the test session's worker pools.
SANDBOX_DIR = sandbox_root(f"{os.getpid()}-pools")
# Trajectory stores of the test session's farms: one per Redis (a store belongs to one farm:
# its sweeps delete what that farm's Redis does not know).
STORE_ROOT = f"/tmp/prs-{os.getpid()}-store"


def store_dir(redis_url: str) -> str:
    """The trajectory store of the farm on ``redis_url`` (writable by pools run as nobody)."""
    path = os.path.join(STORE_ROOT, redis_url.rsplit(":", 1)[-1].replace("/", "-"))
    os.makedirs(path, exist_ok=True)
    os.chmod(STORE_ROOT, 0o755)
    os.chmod(path, 0o777)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_slots(r: redis.Redis, queue: str = "init", n: int = 100_000) -> None:
    """Register a stand-in pool's ``n`` slots of ``queue`` (what a pool does as it starts,
    lua/fair_fill.lua), so that what waits for that queue is pushed onto it, no pool
    consuming it."""
    from prorl_farm import keys
    from prorl_farm.lua import Scripts

    Scripts(r)("fair_fill", slots=keys.slots(queue), held=keys.held(queue),
               pens=keys.pen_flows(queue), weights=keys.WEIGHTS, queue=queue,
               pool="stand-in", shared=n, reserve=0, ttl_s=3600, limit=n,
               tenant_weights=[])


def active_in(r: redis.Redis, job_ids, stage: str) -> set[str]:
    """Those of ``job_ids`` a pool of ``stage`` is running now (claimed, not yet ended)."""
    from prorl_farm import keys

    return {i for i in job_ids if r.hmget(keys.job(i), "state", "phase") == [stage, "active"]}


def waiting_on(r: redis.Redis, queue: str) -> int:
    """Jobs waiting on ``queue``: its messages not yet claimed, and the jobs in its pens
    waiting for a slot (lua/lib/fair.lua)."""
    from prorl_farm import keys

    pens = r.smembers(keys.pen_flows(queue))
    return r.zcard(keys.queued(queue)) + sum(r.zcard(keys.pen(queue, f)) for f in pens)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            what = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


class TcpListener:
    """A TCP server on a free loopback port, for tests that stand between a client and a
    service (proxies that lose or cut traffic): each connection goes to :meth:`handle` in
    a thread of its own."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.listener.close()


class RedisServer:
    """A private redis-server on a free port, data in ``tmp``."""

    def __init__(self, tmp: Path, appendonly: bool = False, fsync: str = "everysec"):
        if not shutil.which("redis-server"):
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.tmp = tmp
        self.appendonly = appendonly
        self.fsync = fsync
        tmp.mkdir(parents=True, exist_ok=True)
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.tmp), "--save", "", "--appendonly", "yes" if self.appendonly else "no",
             "--appendfsync", self.fsync,
             # as the farm's own Redis servers run (prorl_farm/keys.py)
             "--hash-max-listpack-value", str(HASH_MAX_LISTPACK_VALUE)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        wait_until(lambda: self._ping(client), 10, what="redis-server")
        client.close()

    def restart(self, down_s: float = 1.0) -> None:
        """Stop the server (persisting its data if append-only), wait, start it again."""
        self.stop()
        time.sleep(down_s)
        self.start()

    @staticmethod
    def _ping(client) -> bool:
        try:
            return client.ping()
        except redis.exceptions.ConnectionError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def kill(self) -> None:
        """kill -9: no shutdown, no final write (what survives is what was fsynced)."""
        self.proc.kill()
        self.proc.wait(timeout=10)


class Pools:
    """The three worker pools as real `prorl-farm worker <stage>` processes."""

    live: ClassVar[set[Pools]] = set()  # those started and not yet stopped

    def __init__(self, env: dict, log_dir: Path, user: str | None = None):
        self.env = env
        self.log_dir = log_dir
        # Run the pools as this user (root runs them with `runuser`, on the system's Python
        # with the farm's packages on PYTHONPATH, as an operator without root would).
        self.user = user
        self.procs: dict[str, subprocess.Popen] = {}
        self.r = redisconn.client(env["PRORL_REDIS_URL"], decode_responses=True, failover_s=20)

    def start(self, *stages: str, wait: bool = True) -> None:
        Pools.live.add(self)
        for stage in stages or STAGES:
            log = open(self.log_dir / f"{stage}.log", "ab")  # noqa: SIM115
            self.procs[stage] = subprocess.Popen(
                self._argv(stage), env=self._env(), cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
        if wait:
            for stage in stages or STAGES:
                self.wait_ready(stage)

    def _argv(self, stage: str) -> list[str]:
        cmd = ["-m", "prorl_farm.cli", "worker", stage]
        if self.user is None:
            return [sys.executable, *cmd]
        python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
        return [shutil.which("runuser"), "-u", self.user, "--", python, *cmd]

    def _env(self) -> dict:
        if self.user is None:
            return self.env
        site = next(p for p in sys.path if p.endswith("site-packages") and ".venv" in p)
        return {**self.env, "PYTHONPATH": f"{ROOT}:{site}", "HOME": "/tmp"}

    def wait_ready(self, stage: str, after: float | None = None) -> None:
        node = self.env["PRORL_NODE"]
        after = time.time() if after is None else after
        wait_until(lambda: (self.r.zscore("prorl:pools", f"{stage}:{node}") or 0) >= after, 30,
                   what=f"{stage} pool heartbeat")

    def pause(self, stage: str) -> None:
        """SIGSTOP to the stage's pool, its whole process group: it ends no job and its
        Redis connections stay open (the reaper learns nothing) until it is killed, so what
        it holds can be read exactly before a kill."""
        os.killpg(self.procs[stage].pid, signal.SIGSTOP)

    def kill(self, stage: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(stage)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def stop(self) -> None:
        for stage in list(self.procs):
            proc = self.procs[stage]
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for stage in list(self.procs):
            proc = self.procs.pop(stage)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        Pools.live.discard(self)
        self.r.close()


def nobody_can_run_pools() -> bool:
    """Root here, with runuser, a system Python of this version, and a checkout that user
    nobody can read: what running the pools as nobody needs."""
    from prorl_farm.sandbox.interpreter import usable_by

    python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    return (os.geteuid() == 0 and bool(shutil.which("runuser")) and os.path.exists(python)
            and usable_by(str(ROOT / "prorl_farm"), 65534, 65534))


def pool_user(param: str) -> str | None:
    """The user to run the pools as for a fixture parametrised ``root`` / ``nobody``: None
    means as we are. Skips the case this host cannot run (not root: the unprivileged run
    covers it)."""
    import pytest

    if os.geteuid() != 0:
        if param == "root":
            pytest.skip("not root here: the unprivileged run covers this host")
        return None
    if param == "nobody":
        if not nobody_can_run_pools():
            pytest.skip("needs runuser, a system Python of this version, and a checkout "
                        "user nobody can read")
        return "nobody"
    return None


def readable_copy(path: Path, under: Path) -> str:
    """A world-readable copy of ``path`` (e.g. a tokenizer) in a new directory under
    ``under``, for pools that run as another user."""
    import tempfile

    dest = shutil.copytree(path, Path(tempfile.mkdtemp(dir=under)) / Path(path).name)
    subprocess.run(["chmod", "-R", "a+rX", os.path.dirname(dest)], check=True)
    return str(dest)


# A docker sandbox is also its engine's client processes (`docker run`, then a pool's
# `docker kill`) and its container's shim and runc: it has stopped when they are gone too,
# not only the processes inside it.
_DOCKER_SIDE = ("prorl.sandbox=", "docker kill prorl-")
_ENGINE_SIDE = ("runc", "containerd-shim", "containerd-shim-runc-v2")


def own_processes(pattern: str | None = None) -> list:
    """What this test process started: its descendants, and the processes of the
    containers of the Docker engines among them (a container's shim is reparented to init,
    not to the engine: it is found by the engine's exec root on its command line). Nothing
    else on the machine: another worker of the suite, or a farm running beside it. With
    ``pattern`` (a regular expression, as ``pgrep -f`` takes), the command lines of those
    that match it."""
    import psutil

    if pattern is not None:
        import re

        lines = []
        for p in own_processes():
            try:
                line = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if re.search(pattern, line):
                lines.append(f"{p.pid} {line[:120]}")
        return lines

    procs = psutil.Process().children(recursive=True)
    roots = []
    for p in procs:
        try:
            argv = p.cmdline()
            if os.path.basename(argv[0]) == "dockerd" and "--exec-root" in argv:
                roots.append(argv[argv.index("--exec-root") + 1].rstrip("/") + "/")
        except (psutil.Error, IndexError):
            continue
    if roots:
        for p in psutil.process_iter():
            try:
                argv = p.cmdline()
                if (argv and os.path.basename(argv[0]).startswith("containerd-shim")
                        and any(root in " ".join(argv) for root in roots)):
                    procs += [p, *p.children(recursive=True)]
            except psutil.Error:
                continue
    return procs


def sandbox_processes() -> list[int]:
    """The processes of the sandboxes this test process started (:func:`own_processes`):
    those that carry a sandbox id in their environment, and a docker sandbox's processes on
    the engine's side."""
    import psutil

    out = []
    for p in own_processes():
        try:
            line = " ".join(p.cmdline())
            if ("PRORL_SANDBOX_ID" in p.environ() or p.name() in _ENGINE_SIDE
                    or any(mark in line for mark in _DOCKER_SIDE)):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def part_param(name: str):
    """A fixture parameter that starts a shared real part (``docker``, ``vllm``): its tests
    join the part's group (tests/conftest.py: SHARED_PARTS)."""
    import pytest

    return pytest.param(name, marks=pytest.mark.part(name))


def docker_settings(request) -> dict:
    """For a farm fixture's ``docker`` param: the settings of docker sandboxes on the
    session's private engine (tests/docker_engine.py), whose client is found through
    DOCKER_HOST (set for the module); {} for any other param."""
    if request.param != "docker":
        return {}
    from tests.docker_engine import BASE

    engine = request.getfixturevalue("docker_engine")
    mp = request.getfixturevalue("module_monkeypatch")
    mp.setenv("DOCKER_HOST", engine.env["DOCKER_HOST"])
    return {"sandbox_runtime": "docker", "sandbox_image": BASE}


def farm_env(redis_url: str, **overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    env.update({
        "PRORL_REDIS_URL": redis_url,
        "PRORL_NODE": "testnode",
        "PRORL_HEARTBEAT_INTERVAL_S": "0.2",
        # Long enough that a pool starved of CPU by the suite's other workers is not taken
        # for dead (the fault tests that kill pools set their own, shorter, and run alone).
        "PRORL_HEARTBEAT_STALE_S": "15",
        "PRORL_REAP_INTERVAL_S": "0.5",
        "PRORL_INIT_CONCURRENCY": "16",
        "PRORL_RUN_CONCURRENCY": "32",
        "PRORL_EVAL_CONCURRENCY": "16",
        "PRORL_LOG_LEVEL": "WARNING",
        "PRORL_SANDBOX_DIR": SANDBOX_DIR,
        "PRORL_STORE_DIR": store_dir(redis_url),
        "PYTHONPATH": str(ROOT),
    })
    env.update({f"PRORL_{k.upper()}": str(v) for k, v in overrides.items()})
    return env


@contextlib.contextmanager
def scripted_farm(redis_url: str, log_dir: Path, tokenizer: str, plans: dict, tag: str,
                  user: str | None = None, **settings):
    """Real pools (run as ``user``, default: as we are) and an API test client, with a
    scripted policy server playing ``plans`` (see tests/policy_server.py); yields (client,
    server). ``settings`` override the pools' PRORL_* settings. Its sandbox directory goes
    with it.
    """
    from api import create_app
    from prorl_farm.config import load_settings
    from tests.policy_server import PolicyServer, text_planner

    server = PolicyServer(planner=text_planner(tokenizer, plans))
    overrides = dict(sandbox_dir=sandbox_root(f"{tag}-{os.getpid()}"), run_concurrency=8,
                     **settings)
    env = farm_env(redis_url, **overrides)
    if user is not None:
        os.makedirs(overrides["sandbox_dir"], exist_ok=True)
        account = pwd.getpwnam(user)
        os.chown(overrides["sandbox_dir"], account.pw_uid, account.pw_gid)
        os.chmod(log_dir, 0o777)
    pools = Pools(env, log_dir, user=user)
    try:
        pools.start()
        yield create_app(load_settings(env)).test_client(), server
    finally:
        pools.stop()
        server.kill()
        shutil.rmtree(overrides["sandbox_dir"], ignore_errors=True)


def gunicorn_api(env: dict, port: int, log_path) -> subprocess.Popen:
    """The API under gunicorn, as deployed (its own process group)."""
    from prorl_farm.cli import api_argv
    from prorl_farm.config import load_settings

    log = open(log_path, "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        api_argv(load_settings({**env, "PRORL_API_THREADS": "8"}), "127.0.0.1", port),
        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def stop_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def http_farm(redis_url: str, log_dir: Path, tag: str, **settings):
    """Real pools and the API under gunicorn on a free port; yields (url, env). ``settings``
    override the PRORL_* settings. Its sandbox directory goes with it."""
    from prorl_farm.trainer import FarmClient

    sandbox_dir = sandbox_root(f"{tag}-{free_port()}")
    pools = Pools(farm_env(redis_url, sandbox_dir=sandbox_dir, **settings), log_dir)
    port = free_port()
    api = gunicorn_api(pools.env, port, log_dir / "api.log")
    try:
        pools.start()
        url = f"http://127.0.0.1:{port}"
        wait_until(FarmClient(url).ready, 30, 0.2, "api ready")
        yield url, pools.env
    finally:
        stop_process(api)
        pools.stop()
        shutil.rmtree(sandbox_dir, ignore_errors=True)


def needs_bwrap_and_git():
    """The marks of a slow suite that grades in bubblewrap sandboxes with git."""
    import pytest

    return [pytest.mark.slow, pytest.mark.skipif(
        not shutil.which("bwrap") or not shutil.which("git"),
        reason="needs bubblewrap and git")]


def use_only_backend(client, **spec) -> str:
    """Unregister every backend, register this one; returns its id."""
    for b in client.get("/v1/backends").get_json()["backends"]:
        client.delete(f"/v1/backends/{b['id']}")
    resp = client.post("/v1/backends", json=spec)
    assert resp.status_code == 201, resp.get_json()
    return resp.get_json()["id"]


def run_batch(client, body: dict, timeout_s: float = 120) -> list[dict]:
    """Submit ``body`` to POST /v1/jobs, wait until the batch is complete, return its jobs
    in submission order."""
    resp = client.post("/v1/jobs", json=body)
    assert resp.status_code == 202, resp.get_json()
    sub = resp.get_json()
    wait_until(lambda: client.get(f"/v1/batches/{sub['batch_id']}").get_json()["complete"],
               timeout_s, 0.2, f"{body.get('handler')} batch")
    return [client.get(f"/v1/jobs/{j}").get_json() for j in sub["job_ids"]]


def shmem_kb() -> int:
    """The node's shared memory now (``Shmem``: what every tmpfs holds), in KiB."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


def scrape(client, token: str = "") -> dict[tuple, float]:
    """GET /metrics through a Flask test client (or a URL), with the operator's ``token``
    where the farm has keys: {(sample name, sorted labels): value}, parsed by
    prometheus_client's own parser (a malformed exposition fails here)."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if isinstance(client, str):
        import requests

        resp = requests.get(client.rstrip("/") + "/metrics", timeout=10, headers=headers)
        assert resp.status_code == 200
        text = resp.text
    else:
        resp = client.get("/metrics", headers=headers)
        assert resp.status_code == 200
        text = resp.get_data(as_text=True)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _chromium(profile, *args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    import pytest

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("chromium is not installed (make test installs it)")
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=8000", *args],
        capture_output=True, text=True, timeout=timeout_s)


def chromium_dom(url: str, profile) -> str:
    """The page's DOM after its scripts ran (headless Chromium)."""
    return _chromium(profile, "--dump-dom", url).stdout


def chromium_screenshot(url: str, profile, path, size: str = "1400,1100") -> Path:
    """A PNG of the page after its scripts ran."""
    out = _chromium(profile, f"--screenshot={path}", f"--window-size={size}",
                    "--hide-scrollbars", url)
    assert Path(path).exists(), out.stderr[-2000:]
    return Path(path)


def sampled_ids(trajectory: dict) -> list[int]:
    """The response ids the policy sampled (mask 1) of a trajectory or segment."""
    return [t for t, m in zip(trajectory["response_ids"], trajectory["response_mask"]) if m]


def model_server_up(url: str) -> bool:
    """Whether a model server (the dev server, vLLM) answers GET /health with 200."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def serve_model(model_dir, log_path, *args: str):
    """`prorl-farm serve-model` on ``model_dir`` (more ``args`` for it), as a real process;
    yields its URL once /health answers."""
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "prorl_farm.cli", "serve-model", "--model",
                             str(model_dir), "--port", str(port), *args], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    url = ServedUrl(f"http://127.0.0.1:{port}")
    url.proc = proc
    try:
        wait_until(lambda: model_server_up(url), 180, 0.1, "dev model server")
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)
        log.close()


class ServedUrl(str):
    """A model server's URL, with its process (``proc``: a test may kill it)."""

    proc: subprocess.Popen


def require_venv(python: Path, what: str, target: str, flag: str) -> str:
    """The interpreter of a tool's own environment (``make TARGET`` builds it); skips the
    test where it is not installed, or fails it where ``FLAG=1`` (as `make test` sets once
    it installed it)."""
    import pytest

    if not python.exists():
        why = f"{what}'s environment is not installed ({python}; `make {target}` makes it)"
        if os.environ.get(flag) == "1":
            pytest.fail(why)
        pytest.skip(why)
    return str(python)


def code_harness_verdict(run, program: str, tests: dict, jail: bool = True,
                         runtime: str = "bwrap") -> dict:
    """The code harness's verdict on ``program`` for a ``code`` instance's ``tests``, run by
    ``run`` (the ``grading_sandbox`` fixture) as EVAL runs it."""
    from prorl_farm.graders import source
    from prorl_farm.handlers.code import CodeInstance, tests_spec

    spec = {**tests_spec(CodeInstance().load({"statement": "s", **tests})), "nonce": "N",
            "jail": jail}
    out = run(runtime, {"solution.py": program, "code_harness.py": source("code_harness.py")},
              ["python3", "-I", "-S", "code_harness.py"], json.dumps(spec))
    return json.loads(out["stdout"].strip().splitlines()[-1][2:])
