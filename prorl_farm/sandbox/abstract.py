"""The Runtime ABC: start a sandbox running the tool server, stop it, tell if it lives."""

from __future__ import annotations

import os
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prorl_farm.errors import FarmError

SANDBOX_ENV = "PRORL_SANDBOX_ID"
IP_ENV = "PRORL_SANDBOX_IP"


class SandboxError(FarmError, RuntimeError):
    """A sandbox could not be started or reached."""


@dataclass(frozen=True)
class Limits:
    """Per-process resource limits (setrlimit) applied to everything in the sandbox."""

    cpu_s: int = 3600
    address_space_bytes: int = 8 * 1024**3
    processes: int = 512
    file_size_bytes: int = 4 * 1024**3
    open_files: int = 4096


@dataclass(frozen=True)
class SandboxSpec:
    """What a handler asks for in INIT."""

    workspace_files: dict[str, str] = field(default_factory=dict)  # relative path -> text
    env: dict[str, str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    network: bool = False  # outside network (only runtimes that can isolate honour False)
    image: str = ""  # apptainer/docker image; ignored by local and bwrap
    start_timeout_s: float = 30.0


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
    uid: int = -1  # the unprivileged uid it runs as (-1: the farm's own)
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

    @abstractmethod
    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, uid: int) -> Sandbox:
        """Start the tool server inside a new sandbox; return once its socket exists."""

    def stop(self, sandbox: Sandbox, grace_s: float = 2.0) -> None:
        """SIGTERM the sandbox's process group, SIGKILL after ``grace_s``, then every
        process still carrying its id."""
        kill_group(sandbox.pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while time.monotonic() < end and pid_alive(sandbox.pid):
            time.sleep(0.02)
        kill_group(sandbox.pid, signal.SIGKILL)
        for pid in processes_of(sandbox.id):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        reap(sandbox.pid)

    def alive(self, sandbox: Sandbox) -> bool:
        """True while the sandbox's main process runs."""
        return pid_alive(sandbox.pid)


def kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def reap(pid: int) -> None:
    """Collect the exit status if ``pid`` is our child (no zombie left behind)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def processes_of(sandbox_id: str) -> list[int]:
    """Every process on this host whose environment carries the sandbox's id."""
    needle = f"{SANDBOX_ENV}={sandbox_id}".encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return out
