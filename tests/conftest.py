"""Fixtures: a real redis-server per session, real worker pools, the API app."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest
import redis

from prorl_farm.config import load_settings
from tests.farm import SANDBOX_DIR, STORE_ROOT, Pools, RedisServer, farm_env, own_processes

CI = bool(os.environ.get("CI"))

# The real parts started once per pytest session and shared by the tests that use them: under
# pytest-xdist (tests/suite.py runs ``--dist loadgroup``) every test of a part's group runs on
# one worker, which starts the part once; its processes are that worker's, so the leak check
# of every test sees them as the session's, on that worker only. A test is in a part's group
# when it uses the part's fixture, or when a parameter of one of its fixtures is marked with
# ``part`` (module fixtures parametrised by runtime or engine start the part through
# request.getfixturevalue: tests.farm.part_param). Every test of a part is ``slow`` too, so
# that `make check` leaves them out.
SHARED_PARTS = {"docker": ("docker_engine",), "vllm": ("vllm_server",), "verl": ("verl_host",)}
# Modules whose farms (pools, a scripted policy, repositories) are module fixtures: their
# tests (those of no part) run on one worker, which starts each farm once. Spread over the
# workers, each worker started its own: 4 root and 4 nobody red-team farms, for 1 and 1.
FARM_MODULES = {"test_reward_hacking", "test_swe", "test_code", "test_validate",
                "test_swebench", "test_confinement", "test_harness", "test_agent",
                "test_trainer", "test_tokens", "test_cli_harnesses", "test_gym"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        groups = {m.args[0] for m in item.iter_markers("part")}
        groups |= {group for group, fixtures in SHARED_PARTS.items()
                   if set(fixtures) & set(item.fixturenames)}
        if len(groups) > 1:
            raise pytest.UsageError(f"{item.nodeid} uses {' and '.join(sorted(groups))}: a "
                                    "test uses one shared part at most")
        if groups:
            item.add_marker(pytest.mark.xdist_group(groups.pop()))
            item.add_marker(pytest.mark.slow)
        elif item.module.__name__.rsplit(".", 1)[-1] in FARM_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # The longest work first, so that no worker starts it last: the parts' groups (minutes
    # each on one worker), then the slow tests, then the rest; in file order within each.
    items.sort(key=lambda item: 0 if item.get_closest_marker("xdist_group") else
               1 if item.get_closest_marker("slow") else 2)


_CONFIG: list = []


RESULTS = Path(__file__).resolve().parent.parent / ".prorl" / "test-results"
CPUACCT = Path("/sys/fs/cgroup/cpuacct")  # cgroup v1's CPU accounting, where mounted
_cpu: dict = {}


def pytest_configure(config):
    _CONFIG.append(config)
    if not config.pluginmanager.hasplugin("dsession"):
        _account_cpu()


def _account_cpu() -> None:
    """This pytest process (a worker) and all it starts, in a CPU accounting group of its own,
    so that each test's CPU time, with its servers and subprocesses (not its containers'),
    can be told (.prorl/test-results/cpu-WORKER.txt; tests/suite.py prints the largest).
    Where there is no writable cgroup v1 ``cpuacct``, nothing is measured."""
    group = CPUACCT / "prorl-tests" / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-" \
        f"{os.getpid()}"
    try:
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return
    _cpu["usage"] = group / "cpuacct.usage"


def pytest_unconfigure(config):
    usage = _cpu.pop("usage", None)
    if usage is not None:
        with contextlib.suppress(OSError):  # back to the root group; the group goes if empty
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
            usage.parent.rmdir()


def _cpu_s() -> float | None:
    try:
        return int(_cpu["usage"].read_text()) / 1e9 if "usage" in _cpu else None
    except (OSError, ValueError):
        return None


def pytest_runtest_logstart(nodeid, location):
    """When each test starts, on which worker: .prorl/test-results/timeline-WORKER.txt (what
    ran beside what, for the suite's own timing; tests/suite.py reads the JUnit files)."""
    if _CONFIG and _CONFIG[0].pluginmanager.hasplugin("dsession"):
        return  # the controller of xdist's workers: each worker writes its own
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / f"timeline-{worker}.txt", "a") as f:
        f.write(f"{time.time():.1f} {nodeid}\n")
    _cpu["start"] = _cpu_s()


def pytest_runtest_logfinish(nodeid, location):
    """The CPU seconds the test and what it started took: cpu-WORKER.txt."""
    start, end = _cpu.pop("start", None), _cpu_s()
    if start is None or end is None:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(RESULTS / f"cpu-{worker}.txt", "a") as f:
        f.write(f"{end - start:.1f} {nodeid}\n")


@pytest.fixture(autouse=True)
def _collect_what_the_test_left():
    """Whatever a test leaves unclosed (a socket, a file, a pipe) warns at its own teardown,
    failing that test (warnings are errors), not whichever later test or session end the
    garbage collector happens to run in: every subset of the suite, in any order, passes."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session", autouse=True)
def _remove_pool_sandbox_dir():
    """The worker pools' sandbox directory and the farms' trajectory stores go with the
    session (its sandboxes are gone)."""
    yield
    shutil.rmtree(SANDBOX_DIR, ignore_errors=True)
    shutil.rmtree(STORE_ROOT, ignore_errors=True)


@pytest.fixture
def r(redis_server):
    """A client on the test Redis, with every farm key removed before and after the test.

    Only ``prorl:*`` keys and the farm's queues: kombu's own bindings must survive for
    workers that stay up.
    """
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    _clear(client)
    yield client
    _clear(client)
    client.close()


def _clear(client) -> None:
    """Every farm key but the pools' heartbeats and their slot registrations (fair share):
    those belong to pools a module shares (which renew them only every few ticks), not to a
    test."""
    keys, slots = [], []
    for k in client.scan_iter("prorl:*", count=1000):
        if k.startswith("prorl:fair:") and k.endswith(":slots"):
            slots.append(k)
        elif k != "prorl:pools":
            keys.append(k)
    for k in slots:  # a test's stand-in pools (tests.farm.open_slots) go with the test
        stand_ins = [p for p in client.hkeys(k) if not p.startswith("prorl-worker:")]
        if stand_ins:
            client.hdel(k, *stand_ins)
    keys += [k for pattern in ("init", "run.*", "eval.*")
             for k in client.scan_iter(pattern, count=1000, _type="list")]
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="module")
def module_monkeypatch():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory):
    """A private Docker engine with the base images built on it (tests/docker_engine.py);
    skips, saying why, where none can start, unless REQUIRE_DOCKER=1 (make test sets it where
    it installed the engine): then it fails."""
    import tempfile

    from tests.docker_engine import DockerEngine, base_images, why_no_engine

    why = why_no_engine()
    if why:
        if os.environ.get("REQUIRE_DOCKER") == "1":
            pytest.fail(f"REQUIRE_DOCKER=1 but {why}")
        pytest.skip(why)
    engine = DockerEngine(Path(tempfile.mkdtemp(prefix="prs-docker-", dir="/var/tmp")))
    try:
        engine.build_times = {"base_images_s": base_images(engine)}
        yield engine
    finally:
        engine.stop()


def make_pools(redis_server, tmp_path, **overrides) -> Pools:
    pools = Pools(farm_env(redis_server.url, **overrides), tmp_path)
    return pools


@pytest.fixture(scope="module")
def pools(redis_server, tmp_path_factory):
    """The three pools with the default test settings, shared by a module's tests."""
    p = make_pools(redis_server, tmp_path_factory.mktemp("pools"))
    p.start()
    yield p
    p.stop()


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> str:
    """The path of a real tokenizer (character-level, ChatML template), for backends whose
    jobs never render a prompt: a registration's tokenizer must load."""
    from prorl_farm.dev.tiny import build_char_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    build_char_tokenizer(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen2 and a BPE tokenizer with a ChatML template, built offline."""
    from prorl_farm.dev.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def require_vllm() -> str:
    """The interpreter of vLLM's environment; skips the test where vLLM cannot run here,
    or fails it where REQUIRE_VLLM=1 (as `make test` sets once it installed vLLM)."""
    import os

    from prorl_farm.dev.engines import choose

    engine, python, why = choose("vllm")
    if engine != "vllm":
        if os.environ.get("REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is required here but cannot run: {why}")
        pytest.skip(f"vLLM's CPU build cannot run here: {why}")
    return python


VLLM_CONTEXT = 65_536


def start_vllm(model_dir, log_dir, max_model_len: int, name: str = "tiny"):
    """vLLM's CPU build serving ``model_dir`` in float32 (a real process group), or a skip
    (:func:`require_vllm`). Returns (url, stop)."""
    import os
    import shutil
    import signal
    import subprocess
    import tempfile

    from prorl_farm.dev.engines import vllm_command
    from tests.farm import free_port, model_server_up, wait_until

    python = require_vllm()
    port = free_port()
    argv, env = vllm_command(python, str(model_dir), "127.0.0.1", port, name,
                             max_model_len=max_model_len)
    # vLLM's processes talk over ZMQ sockets it names in this folder; a killed engine
    # leaves them behind, so they go with it (short: a socket's path has 107 bytes).
    sockets = tempfile.mkdtemp(prefix="prorl-vllm-", dir="/tmp")
    env["VLLM_RPC_BASE_PATH"] = sockets
    log = open(log_dir / "vllm.log", "wb")  # noqa: SIM115 - closed by stop()
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine core and its workers
        except ProcessLookupError:
            pass
        shutil.rmtree(sockets, ignore_errors=True)
        log.close()

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM exited {proc.returncode}; see {log_dir}/vllm.log")
        return model_server_up(url)

    try:
        wait_until(up, 600, 0.5, "vLLM to start")
    except BaseException:
        stop()
        raise
    return url, stop


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    """The tiny model vLLM serves (a copy: weight syncs point the engine elsewhere), with
    the 64k positions a Claude Code prompt needs."""
    from prorl_farm.dev.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-model"), max_positions=VLLM_CONTEXT)


@pytest.fixture(scope="session")
def vllm_server(vllm_model, tmp_path_factory):
    """Real vLLM (CPU build, float32) on the tiny untied model, 64k tokens of context (what
    Claude Code needs; one engine for all the tests that share it)."""
    url, stop = start_vllm(vllm_model, tmp_path_factory.mktemp("vllm"), VLLM_CONTEXT)
    yield url
    stop()


@pytest.fixture(scope="session")
def dev_server(tiny_model, tmp_path_factory):
    """`prorl-farm serve-model` on the tiny model, as a real process."""
    from tests.farm import serve_model

    with serve_model(tiny_model, tmp_path_factory.mktemp("dev-server") / "server.log") as url:
        yield url


@pytest.fixture
def settings(redis_server):
    env = farm_env(redis_server.url)
    return load_settings(env)


@pytest.fixture
def app(settings):
    from api import create_app

    return create_app(settings)


@pytest.fixture
def client(app, r):
    return app.test_client()


# A job is reported ended before its sandboxes are stopped (the trainer does not wait on
# the cleanup): a test that ends with its batch may see the stop still under way (a docker
# sandbox's takes the engine a few hundred ms). What is still there after this long is left
# behind.
LEAK_GRACE_S = 15.0


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Every test must leave nothing running of what it started: no process of this test
    process's tree, and no container's process of its Docker engine (:func:`own_processes`,
    which looks at nothing else on the machine, so that the suite's other workers and a farm
    running beside it are not taken for leaks)."""
    before = {p.pid for p in own_processes()}
    pools_before = set(Pools.live)
    yield
    end = time.monotonic() + LEAK_GRACE_S
    while (leaked := _leaked(before, pools_before)) and time.monotonic() < end:
        time.sleep(0.2)
    assert not leaked, f"processes left behind: {leaked}"


def _leaked(before: set[int], pools_before: set[Pools]) -> list[str]:
    # A pool of a set that was there before the test and still is, restarted by the test
    # (as a supervisor would; under runuser where it runs as another user), and its
    # watchdog: the set's, not the test's (they end with it). Not what the pool started
    # since: a sandbox left behind is still a leak.
    kept = set()
    for pools in pools_before & Pools.live:
        for proc in pools.procs.values():
            try:
                kept |= {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(
                    recursive=True) if _POOL_MARKS.intersection(c.cmdline())}
            except psutil.NoSuchProcess:
                pass
    leaked = []
    for p in own_processes():
        if p.pid in before or p.pid in kept:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE or _pools_own(p, before | kept):
                continue
            leaked.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return leaked


_POOL_MARKS = {"prorl_farm.cli", "prorl_farm.watchdog"}  # `python -m` of a pool, a watchdog


def _pools_own(p: psutil.Process, before: set[int]) -> bool:
    """An answer-grading helper of a pool that was there before the test and still is: the
    pool keeps it for the next answer (it ends with its pool, or idle)."""
    return ("prorl_farm.graders.answers" in " ".join(p.cmdline())
            and p.ppid() in before)


@pytest.fixture
def grading_sandbox(r, tmp_path, request, monkeypatch):
    """Runs a grader script in a fresh sandbox of a runtime, as EVAL does; yields
    run(runtime, files, argv, stdin) -> the exec result. ``docker`` uses the session's
    private engine and the base image built there."""
    from prorl_farm.sandbox.abstract import Limits, SandboxSpec
    from prorl_farm.sandbox.connection import ToolConnection
    from prorl_farm.sandbox.manager import SandboxManager

    managers = {}

    def run(runtime: str, files: dict, argv: list[str], stdin: str | None = None,
            env: dict | None = None) -> dict:
        if runtime not in managers:
            image = ""
            if runtime == "docker":
                from tests.docker_engine import BASE

                engine = request.getfixturevalue("docker_engine")
                monkeypatch.setenv("DOCKER_HOST", engine.env["DOCKER_HOST"])
                image = BASE
            managers[runtime] = SandboxManager(r, "grading-node", runtime,
                                               root=f"/tmp/prs-grading-{os.getpid()}",
                                               image=image)
        manager = managers[runtime]
        sandbox = manager.start(SandboxSpec(workspace_files=files, limits=Limits(
            processes=64)))
        client = ToolConnection(sandbox.socket)
        try:
            return client.call("exec", argv=argv, timeout_s=120, stdin=stdin, env=env or {})
        finally:
            client.close()
            manager.stop(sandbox)

    yield run
    shutil.rmtree(f"/tmp/prs-grading-{os.getpid()}", ignore_errors=True)
