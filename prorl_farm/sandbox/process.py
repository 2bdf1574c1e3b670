"""Starting a sandbox's main process: limits, cgroup, parent-death signal, readiness."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from prorl_farm.errors import SandboxError

PR_SET_PDEATHSIG = 1
SANDBOX_ENV = "PRORL_SANDBOX_ID"
IP_ENV = "PRORL_SANDBOX_IP"


@dataclass(frozen=True)
class Limits:
    """Per-process resource limits (setrlimit) applied to everything in the sandbox."""

    cpu_s: int = 3600
    address_space_bytes: int = 8 * 1024**3
    processes: int = 512
    file_size_bytes: int = 4 * 1024**3
    open_files: int = 4096


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


def user_process_count(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += 1
            except FileNotFoundError:
                continue
    return n


def preexec(limits: Limits, cgroup: Path | None, die_with_parent: bool = True):
    """Runs in the child between fork and exec: new session, join the sandbox's pids
    cgroup, rlimits. Without a cgroup the process cap is RLIMIT_NPROC, which counts every
    process of the uid: the sandbox gets its budget on top of what the uid runs now (and
    root, whom RLIMIT_NPROC does not bind, needs the cgroup)."""
    nproc = user_process_count(os.geteuid()) + limits.processes
    procs_file = str(cgroup / "cgroup.procs") if cgroup is not None else None

    def run() -> None:
        os.setsid()
        if procs_file is not None:
            with open(procs_file, "w") as f:
                f.write(str(os.getpid()))
        if die_with_parent:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for res, value in ((resource.RLIMIT_CPU, limits.cpu_s),
                           (resource.RLIMIT_AS, limits.address_space_bytes),
                           (resource.RLIMIT_FSIZE, limits.file_size_bytes),
                           (resource.RLIMIT_NOFILE, limits.open_files),
                           (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
        if procs_file is None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return run


# The parent-death signal fires when the *thread* that forked the child exits, not only the
# process. Pool threads come and go, so every sandbox is forked from this one long-lived
# thread: sandboxes die with the worker process, never with a finished task thread.
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox-spawner")


def spawn(argv: list[str], env: dict, limits: Limits, cgroup: Path | None, log_path: Path,
          cwd: str | None = None) -> subprocess.Popen:
    def start() -> subprocess.Popen:
        with open(log_path, "ab") as log:
            return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=preexec(limits, cgroup), close_fds=True)

    return _spawner.submit(start).result()


def wait_ready(proc: subprocess.Popen, socket_path: Path, timeout_s: float, log_path: Path
               ) -> None:
    """Until the tool server's socket appears; fail fast if the process dies."""
    end = time.monotonic() + timeout_s
    while not socket_path.exists():
        if proc.poll() is not None or not pid_alive(proc.pid):
            raise SandboxError(f"sandbox exited ({proc.returncode}) before its tool server "
                               f"was up: {tail(log_path)}")
        if time.monotonic() > end:
            raise SandboxError(f"tool server not up after {timeout_s} s: {tail(log_path)}")
        time.sleep(0.005)


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def server_argv(socket_path: str, workspace: str, runtime_dir: str,
                python: str = sys.executable) -> list[str]:
    return [python, "-m", "prorl_farm.sandbox.server", "--socket", socket_path,
            "--workspace", workspace, "--runtime-dir", runtime_dir]


def python_paths() -> list[str]:
    """Directories the tool server's interpreter and packages live in."""
    import prorl_farm

    pkg_root = str(Path(prorl_farm.__file__).resolve().parent.parent)
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), pkg_root}
    for p in sys.path:
        if p and os.path.isdir(p) and "site-packages" in p:
            paths.add(os.path.realpath(p))
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if p and os.path.isdir(p):
            paths.add(os.path.realpath(p))
    return sorted(paths)
