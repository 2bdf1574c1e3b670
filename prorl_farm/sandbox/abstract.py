"""The Runtime ABC: start a sandbox running the tool server, stop it, tell if it lives."""

from __future__ import annotations

import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prorl_farm.errors import SandboxError
from prorl_farm.sandbox.process import (
    Limits,
    kill_group,
    listen_socket,
    pid_alive,
    processes_of,
    reap,
    spawn,
    wait_ready,
)
from prorl_farm.toolserver.protocol import (
    GATEWAY_PORT,
    GATEWAY_SOCKET,
    INSIDE_GATEWAY_DIR,
    INSIDE_HARNESSES,
)

__all__ = ["GATEWAY_PORT", "GATEWAY_SOCKET", "INSIDE_GATEWAY_DIR", "INSIDE_HARNESSES",
           "DISK_SCRATCH", "Limits", "Runtime", "disk_scratch", "Sandbox", "SandboxError",
           "SandboxSpec", "chown_tree", "gateway_dir", "gateway_env", "gateway_relay",
           "kill_group", "pid_alive", "processes_of", "reap"]


def chown_tree(path: Path, uid: int, gid: int) -> None:
    """Give ``path`` and everything under it (links themselves, not followed) to uid:gid."""
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            os.lchown(name, uid, gid)


# A sandbox's scratch on the node's disk, not in its memory: its /tmp and /var/tmp are
# directories beside its workspace (inside -> the host name), gone with it, and counted
# with the workspace against its limit (toolserver/quota.py). Only /dev/shm and /run are
# memory (tmpfs, PRORL_SANDBOX_SCRATCH_MB each).
DISK_SCRATCH = {"/tmp": "tmp", "/var/tmp": "var-tmp"}


def disk_scratch(workspace: str | Path) -> dict[str, Path]:
    """Where, on the host, a sandbox's /tmp and /var/tmp are (inside -> host)."""
    base = Path(workspace).parent
    return {inside: base / name for inside, name in DISK_SCRATCH.items()}


def gateway_dir(workspace: str | Path) -> Path:
    """Where, on the host, a sandbox's model gateway puts its socket (bound in at
    INSIDE_GATEWAY_DIR): beside its workspace, gone with it."""
    return Path(workspace).parent / "gw"


def gateway_env(ip: str) -> dict[str, str]:
    """Where a harness's SDKs find the job's model gateway inside a sandbox: the tool
    server's relay on the sandbox's loopback address."""
    return {"OPENAI_BASE_URL": f"http://{ip}:{GATEWAY_PORT}/v1",
            "ANTHROPIC_BASE_URL": f"http://{ip}:{GATEWAY_PORT}"}


def gateway_relay() -> str:
    """The tool server's ``--gateway``: the loopback port it relays to the socket the job's
    gateway puts in INSIDE_GATEWAY_DIR."""
    return f"{GATEWAY_PORT}:{INSIDE_GATEWAY_DIR}/{GATEWAY_SOCKET}"


@dataclass(frozen=True)
class SandboxSpec:
    """What a handler asks for in INIT."""

    # relative path -> text or bytes
    workspace_files: dict[str, str | bytes] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    network: bool = False  # outside network (only runtimes that can isolate honour False)
    image: str = ""  # apptainer/docker image; ignored by local and bwrap
    start_timeout_s: float = 30.0
    # Extra read-only paths, inside -> host. Checked by the SandboxManager against the
    # operator's PRORL_SANDBOX_MOUNT_ROOTS (instances are untrusted input).
    ro_paths: dict[str, str] = field(default_factory=dict)
    # A door to the job's model gateway: its Unix socket's directory bound in, a loopback
    # port relayed to it, and OPENAI_BASE_URL / ANTHROPIC_BASE_URL pointing there (the
    # runtimes whose ``serves_gateway``: bwrap, docker).
    gateway: bool = False
    # With the gateway: the operator's harness environments (PRORL_HARNESS_DIR), bound
    # read-only at INSIDE_HARNESSES where the directory exists.
    harnesses: str = ""


@dataclass
class Sandbox:
    """A running sandbox; plain data so it travels between stages as JSON."""

    id: str
    runtime: str
    node: str
    pid: int  # the process the runtime started (group leader)
    workspace: str  # on the host
    socket: str  # the tool server's Unix socket, on the host
    ip: str  # its own loopback address
    cgroup: str = ""  # its pids cgroup, where the farm may create one
    workdir: str = ""  # the workspace as seen inside
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Sandbox:
        return cls(**d)


class Runtime(ABC):
    """Starts and stops sandboxes of one kind on this node."""

    name: str = ""
    # Whether it can open a door to a job's model gateway (SandboxSpec.gateway): bind the
    # socket's directory in and run the tool server's relay where the sandbox's loopback is.
    serves_gateway: bool = False
    # The Popen of each sandbox this process started, by id; a pool's threads start and
    # stop sandboxes at once, so the table is shared under a lock (one per process).
    _procs: dict | None = None
    _procs_lock = threading.Lock()

    def _track(self, sandbox_id: str, proc) -> None:
        """Keep the Popen of a sandbox this process started, to wait for it at stop. A
        sandbox stopped by another process (the EVAL pool, the janitor) is collected here at
        the next start, so no zombie stays behind."""
        with self._procs_lock:
            if self._procs is None:
                self._procs = {}
            for other, p in list(self._procs.items()):
                if p.poll() is not None:
                    del self._procs[other]
            self._procs[sandbox_id] = proc

    def _untrack(self, sandbox_id: str):
        with self._procs_lock:
            return (self._procs or {}).pop(sandbox_id, None)

    @classmethod
    def from_options(cls, options) -> Runtime:
        """The runtime for a node's sandbox manager (``runtimes.RuntimeOptions``)."""
        return cls()

    @abstractmethod
    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, cgroup: Path | None) -> Sandbox:
        """Start the tool server inside a new sandbox; return once its socket exists."""

    def _launch(self, argv: Callable[[int | str, int], list[str]], env: dict,
                spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
                ip: str, cgroup: Path | None, workdir: str, cwd: str | None = None,
                run_as: tuple[int, int] | None = None, pass_socket: bool = True,
                nproc_inside: bool = False, ready_fifo: Path | None = None,
                keep_fds: tuple[int, ...] = ()) -> Sandbox:
        """Spawn a runtime's command line and wait for its tool server (shared by runtimes).

        ``argv(socket, ready_fd)`` builds the command line. With ``pass_socket`` the host
        makes the listening socket at ``socket_path`` and the server gets its fd (the path
        never enters the sandbox); otherwise ``socket`` is the path for the server to bind
        (image runtimes, whose containers cannot inherit fds). Either way the server says
        "ready" on a pipe: its fd, or with ``ready_fifo`` (a FIFO the caller made where the
        server sees it) that FIFO's path, which ``argv`` gets for ``ready_fd``. ``keep_fds``:
        more fds the spawned process inherits (and holds while it lives)."""
        log = socket_path.parent / "server.log"
        if ready_fifo is not None:
            # Read and write end both here: no EOF before the server writes.
            ready_r, ready_w = os.open(ready_fifo, os.O_RDWR), None
        else:
            ready_r, ready_w = os.pipe()
        listener = listen_socket(socket_path) if pass_socket else None
        fds = ((ready_w,) if ready_w is not None else ()) + (
            (listener.fileno(),) if listener is not None else ()) + keep_fds
        try:
            where: int | str = listener.fileno() if listener is not None else str(socket_path)
            proc = spawn(argv(where, ready_w), env, spec.limits, cgroup, log, cwd=cwd,
                         pass_fds=fds, run_as=run_as, nproc_inside=nproc_inside)
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            if ready_w is not None:
                os.close(ready_w)
            if listener is not None:
                listener.close()  # the server holds it now
        sandbox = Sandbox(sandbox_id, self.name, "", proc.pid, str(workspace), str(socket_path),
                          ip, str(cgroup or ""), workdir)
        self._track(sandbox_id, proc)
        try:
            wait_ready(proc, ready_r, spec.start_timeout_s, log)
        except BaseException:
            self.stop(sandbox, grace_s=0)
            raise
        finally:
            os.close(ready_r)
        return sandbox

    def stop(self, sandbox: Sandbox, grace_s: float = 2.0) -> None:
        """SIGTERM the sandbox's process group, SIGKILL after ``grace_s``, then every
        process still carrying its id."""
        kill_group(sandbox.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while time.monotonic() < end and pid_alive(sandbox.pid):
            time.sleep(0.02)
        kill_group(sandbox.pid, signal.SIGKILL)
        if sandbox.cgroup:
            from prorl_farm.sandbox import cgroups

            cgroups.kill_all_and_remove(Path(sandbox.cgroup))
        for pid in processes_of(sandbox.id):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc = self._untrack(sandbox.id)
        if proc is not None:
            proc.wait(timeout=10)
        else:
            reap(sandbox.pid)

    def alive(self, sandbox: Sandbox) -> bool:
        """True while the sandbox's main process runs."""
        return pid_alive(sandbox.pid)
