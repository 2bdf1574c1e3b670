"""Host-side process control of a sandbox: its limits, cgroup and parent-death signal, starting
its main process, waiting for its tool server to be ready, finding and killing what it runs.
(Which interpreter the tool server runs with, and its command line: interpreter.py.)"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from prorl_farm.errors import SandboxError
from prorl_farm.toolserver.protocol import SANDBOX_ENV

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Limits:
    """Per-process resource limits (setrlimit) applied to everything in the sandbox."""

    cpu_s: int = 3600
    address_space_bytes: int = 8 * 1024**3
    processes: int = 512
    file_size_bytes: int = 4 * 1024**3
    open_files: int = 4096
    # Scheduling priority: below the farm's own processes, so that whatever a sandbox runs
    # (a fork bomb, a busy loop) cannot starve the pools' heartbeats or Redis.
    nice: int = 15
    # Each memory-backed directory (/dev/shm, /run) holds at most this much: writing past it
    # fails with ENOSPC inside, and the node's memory stays as it was (PRORL_SANDBOX_SCRATCH_MB
    # sets it for every sandbox of a node, cut to the node's budget). /tmp and /var/tmp are
    # on disk, in the workspace's bound.
    scratch_bytes: int = 64 * 1024**2
    # The workspace as a whole (a directory on the node's disk): the tool server measures it
    # and kills what writes past this (PRORL_SANDBOX_WORKSPACE_MB; toolserver/quota.py).
    workspace_bytes: int = 4 * 1024**3
    # The CPU group (sandbox/cgroups.py: its tenant's) every process of the sandbox joins at
    # its start, or "" for none.
    cpu_group: str = ""

    @property
    def workspace_mb(self) -> int:
        return self.workspace_bytes >> 20


def parent_death_signal(sig: int) -> None:
    """Ask the kernel to send this process ``sig`` when its parent dies (in a child before
    exec; a change of uid clears it)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


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


def user_task_count(uid: int) -> int:
    """Tasks (threads) the uid runs on this host: what RLIMIT_NPROC counts. A farm that
    runs as the sandboxes' user has pools of many threads each; counting processes only
    left a sandbox too few to start its own threads."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid != uid:
                    continue
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    # num_threads is field 20; the name in field 2 may hold ')' itself.
                    n += int(f.read().rpartition(b")")[2].split()[17])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                continue
    return n


def preexec(limits: Limits, cgroup: Path | None, die_with_parent: bool = True,
            run_as: tuple[int, int] | None = None, nproc_inside: bool = False):
    """Runs in the child between fork and exec: new session, join the sandbox's pids
    cgroup and its tenant's CPU group (``limits.cpu_group``), rlimits, then (``run_as``,
    when the farm is root) the unprivileged host uid and gid the sandbox runs as, with no
    supplementary groups. Without a cgroup the process cap
    is RLIMIT_NPROC, which counts every task (thread) of the uid: the sandbox gets its budget
    on top of what the uid runs now (and root, whom RLIMIT_NPROC does not bind, needs the
    cgroup). That budget is shared by every sandbox of the uid: one that forks without end
    starves the others. With ``nproc_inside`` the sandbox sets its own cap instead, inside
    its user namespace, where the kernel (5.14+) counts only that namespace's tasks: a cap
    per sandbox."""
    uid = run_as[0] if run_as else os.geteuid()
    nproc = user_task_count(uid) + limits.processes
    procs_file = str(cgroup / "cgroup.procs") if cgroup is not None else None
    cpu_file = os.path.join(limits.cpu_group, "cgroup.procs") if limits.cpu_group else None

    def run() -> None:
        os.setsid()
        if limits.nice:
            os.nice(limits.nice)
        if procs_file is not None:  # the process cap: joined, or no sandbox
            with open(procs_file, "w") as f:
                f.write(str(os.getpid()))
        if cpu_file is not None:
            try:  # a share of CPU: where the group cannot be joined, the sandbox runs anyway
                with open(cpu_file, "w") as f:
                    f.write(str(os.getpid()))
            except OSError:
                pass
        if run_as is not None:
            os.setgroups([])
            os.setgid(run_as[1])
            os.setuid(run_as[0])
        if die_with_parent:  # after the uid change, which clears the parent-death signal
            parent_death_signal(signal.SIGKILL)
        for res, value in ((resource.RLIMIT_CPU, limits.cpu_s),
                           (resource.RLIMIT_AS, limits.address_space_bytes),
                           (resource.RLIMIT_FSIZE, limits.file_size_bytes),
                           (resource.RLIMIT_NOFILE, limits.open_files),
                           (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
        if procs_file is None and not nproc_inside:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return run


# The parent-death signal fires when the *thread* that forked the child exits, not only the
# process. Pool threads come and go, so every sandbox is forked from this one long-lived
# thread: sandboxes die with the worker process, never with a finished task thread.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawner")


def spawn(argv: list[str], env: dict, limits: Limits, cgroup: Path | None, log_path: Path,
          cwd: str | None = None, pass_fds: tuple[int, ...] = (),
          run_as: tuple[int, int] | None = None, nproc_inside: bool = False
          ) -> subprocess.Popen:
    def start() -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=preexec(limits, cgroup, run_as=run_as,
                                                       nproc_inside=nproc_inside),
                                    close_fds=True, pass_fds=pass_fds)

    return _spawner.submit(start).result()


def listen_socket(path: Path) -> socket.socket:
    """The tool server's listening socket, made on the host side: its path is never inside
    the sandbox, so nothing in there can remove or replace it; the server gets the fd."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        path.unlink(missing_ok=True)
        sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


def wait_ready(proc: subprocess.Popen, ready_fd: int, timeout_s: float, log_path: Path) -> None:
    """Until the tool server writes "ready" on its readiness pipe; fail fast if it dies
    (the pipe closes) or takes too long."""
    end = time.monotonic() + timeout_s
    got = b""
    while b"ready" not in got:
        left = end - time.monotonic()
        if left <= 0:
            raise SandboxError(f"tool server not up after {timeout_s} s: {tail(log_path)}")
        ready, _, _ = select.select([ready_fd], [], [], min(left, 0.5))
        if not ready:
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(ready_fd, 64)
        if not chunk:
            break
        got += chunk
    if b"ready" not in got:
        proc.poll()
        raise SandboxError(f"sandbox exited ({proc.returncode}) before its tool server was "
                           f"up: {tail(log_path)}")


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""
