"""A private Docker engine for the tests, and the farm's images built on it with no registry.

``DockerEngine`` starts ``dockerd`` as root with its own socket, data, exec root and pid file
in a directory of its own (no bridge firewall rules: the tests use the host network and
``--network none`` only), and stops it by its pid, leaving nothing mounted.

``build_images`` makes the images as an operator without a registry does: the base from
Debian packages (``deploy/base-image.sh``: debootstrap, ``docker import``), then the
Dockerfile's ``farm`` and ``dev-model`` targets on it, their Python packages from a
wheelhouse served on loopback (downloaded once by the base image's own pip, so markers are
judged for the image's Python; torch is the CPU build from this machine's wheels).

The engine's data root (its images and build cache) is kept between runs
(``tests/farm.py:kept``, ``PRORL_TEST_CACHE``), as a CI keeps a layer cache: a run rebuilds
only the layers whose inputs changed (the farm's source, most often), the base image only
when ``deploy/base-image.sh`` or ``deploy/redis.Dockerfile`` changed, the wheelhouse only
when the requirements did. The engine itself starts cold in every run. One run at a time
holds the cache (a lock); a run that finds it held, or ``PRORL_TEST_CACHE=`` (empty), builds
everything on a data root of its own, as on a fresh machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.farm import ROOT, kept, wait_until

BASE = "prorl-base:bookworm"
REDIS = "prorl-redis:bookworm"
FARM = "prorl-farm:latest"
DEV_MODEL = "prorl-farm-dev-model:latest"
TORCH = "torch==2.13.0"  # requirements-dev.txt's CPU build
WHEELS_PORT = 18791  # the wheelhouse's port: fixed where free, so that PIP_OPTS and the
#                      layers built with it stay the same from run to run


def _digest(*paths: Path, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def why_no_engine() -> str | None:
    """Why no Docker engine can be started here, or None."""
    if os.geteuid() != 0:
        return "needs root to start a Docker engine (dockerd) and debootstrap"
    for tool, package in (("dockerd", "docker.io"), ("docker", "docker.io"),
                          ("debootstrap", "debootstrap")):
        if not shutil.which(tool):
            return f"{tool} is not installed (apt-get install {package}; make test does)"
    return None


def _stop_orphans(data: Path) -> None:
    """Stop every ``dockerd`` serving ``data`` (one a killed run left running: its open
    database would keep this run's engine from starting), SIGKILL after 30 s."""
    def serving() -> list[int]:
        out = []
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"dockerd") and b"--data-root" in argv and \
                    argv[argv.index(b"--data-root") + 1:][:1] == [str(data).encode()]:
                out.append(int(entry.name))
        return out

    pids = serving()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        try:
            wait_until(lambda: not serving(), 30, 0.2, "a killed run's dockerd to stop")
            return
        except Exception:  # noqa: BLE001 - it did not stop: SIGKILL
            continue


class DockerEngine:
    """``dockerd`` with its socket, exec root and pid file in ``home``; its data root is the
    kept one (:func:`cache_dir`) where this run can lock it, else ``home/data``."""

    def __init__(self, home: Path):
        self.home = home
        self.home.mkdir(parents=True, exist_ok=True)
        self.cache, self._lock = self._take_cache()
        data = self.cache / "data" if self.cache else home / "data"
        if self.cache:  # the lock is ours: a dockerd still on the data root is a killed run's
            _stop_orphans(data)
        self.socket = home / "docker.sock"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}
        self.log = home / "dockerd.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["dockerd", "--host", f"unix://{self.socket}", "--data-root",
                 str(data), "--exec-root", str(home / "exec"), "--pidfile",
                 str(home / "dockerd.pid"), "--iptables=false", "--ip-masq=false"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until(self._answers, 60, 0.25, "dockerd")
        except Exception as e:
            log = self.log.read_text()[-2000:]
            self.stop()
            raise RuntimeError(f"dockerd did not start ({e}): {log}") from None
        if self.cache:  # what a run that was killed left on the kept data root
            self._remove_containers()
            self.run("volume", "prune", "-f", check=False)
            self.run("network", "prune", "-f", check=False)

    @staticmethod
    def _take_cache() -> tuple[Path | None, int | None]:
        cache = kept("docker")
        if cache is None:
            return None, None
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd = os.open(cache / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        except OSError:
            return None, None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another run holds it: this one builds on its own data root
            os.close(fd)
            return None, None
        return cache, fd

    def _remove_containers(self) -> None:
        ids = self.run("ps", "-aq", check=False, timeout=60).stdout.split()
        if ids:
            self.run("rm", "-f", *ids, check=False, timeout=120)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"dockerd exited: {self.log.read_text()[-2000:]}")
        return self.run("version", check=False).returncode == 0

    def run(self, *args: str, check: bool = True, timeout: float = 600,
            **kwargs) -> subprocess.CompletedProcess:
        out = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True,
                             timeout=timeout, **kwargs)
        if check and out.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)[:300]}: {out.stderr[-3000:]}")
        return out

    def containers(self, *filters: str) -> list[str]:
        """Names of the containers (any state) that match every ``key=value`` filter."""
        args = [a for f in filters for a in ("--filter", f)]
        return self.run("ps", "-a", "--format", "{{.Names}}", *args).stdout.split()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self._remove_containers()
                if self.cache:  # images no tag names any more (earlier builds of the farm)
                    self.run("image", "prune", "-f", check=False, timeout=300)
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # What the engine mounted under its roots (overlays, netns) goes before its files.
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f]
        roots = [str(self.home)] + ([str(self.cache)] if self.cache else [])
        for mount in sorted((m for m in mounts if m.startswith(tuple(roots))), reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


@contextlib.contextmanager
def served(directory: Path, port: int = 0):
    """``directory`` over HTTP on loopback (pip's --find-links), on ``port`` where it is free;
    yields the URL."""
    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Handler, directory=str(directory))

    class Quiet(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass

    try:
        server = Quiet(("127.0.0.1", port), handler)
    except OSError:
        server = Quiet(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def base_images(engine: DockerEngine) -> float:
    """The base and Redis images (deploy/base-image.sh); returns the seconds it took."""
    t = time.monotonic()
    env, stamp = engine.env, None
    if engine.cache:  # images kept from a run with another base-image.sh are made anew
        stamp = engine.cache / "base-images.sha"
        digest = _digest(ROOT / "deploy" / "base-image.sh", ROOT / "deploy" / "redis.Dockerfile")
        if not stamp.exists() or stamp.read_text() != digest:
            env = {**env, "FORCE": "1"}
    out = subprocess.run([str(ROOT / "deploy" / "base-image.sh")], env=env,
                         capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"deploy/base-image.sh: {out.stderr[-3000:]}")
    if stamp is not None:
        stamp.write_text(digest)
    return time.monotonic() - t


def farm_images(engine: DockerEngine, work: Path) -> dict[str, float]:
    """The Dockerfile's farm and dev-model images on the base; returns seconds per step."""
    took = {}
    t = time.monotonic()
    wheels = work / "wheels"
    if engine.cache:  # one wheelhouse per requirements, kept
        key = _digest(ROOT / "requirements.txt", extra=TORCH)
        wheels = engine.cache / f"wheels-{key}"
        for old in engine.cache.glob("wheels-*"):
            if old != wheels:
                shutil.rmtree(old, ignore_errors=True)
    if not (wheels / ".complete").exists():
        wheels.mkdir(parents=True, exist_ok=True)
        local = "/opt/wheels" if os.path.isdir("/opt/wheels") else str(wheels)
        ca = "/etc/ssl/certs/ca-certificates.crt"  # this machine's trust (a proxy's CA too)
        engine.run("run", "--rm", "--network", "host", "-v", f"{ca}:/host-ca.crt:ro",
                   "-v", f"{local}:/local:ro", "-v", f"{wheels}:/wheels",
                   "-v", f"{ROOT / 'requirements.txt'}:/req.txt:ro", BASE, "sh", "-c",
                   "python3 -m venv /tmp/v && /tmp/v/bin/pip download -q "
                   "--disable-pip-version-check --cert /host-ca.crt --find-links /local "
                   f"-d /wheels -r /req.txt setuptools wheel {TORCH}", timeout=900)
        (wheels / ".complete").touch()
    took["wheelhouse_s"] = time.monotonic() - t

    with served(wheels, WHEELS_PORT) as url:
        for target, tag in (("farm", FARM), ("dev-model", DEV_MODEL)):
            t = time.monotonic()
            engine.run("build", "-q", "--force-rm", "--network", "host", "--build-arg",
                       f"BASE={BASE}", "--build-arg",
                       f"PIP_OPTS=--no-index --find-links {url}", "--build-arg",
                       f"TORCH_SPEC={TORCH}", "--target", target, "-t", tag, str(ROOT),
                       timeout=1200)
            took[f"build_{target}_s"] = time.monotonic() - t
    return took
