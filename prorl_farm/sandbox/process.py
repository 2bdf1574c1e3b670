"""Starting a sandbox's main process: limits, cgroup, parent-death signal, readiness."""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import socket
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
    # Scheduling priority: below the farm's own processes, so that whatever a sandbox runs
    # (a fork bomb, a busy loop) cannot starve the pools' heartbeats or Redis.
    nice: int = 15


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
    cgroup, rlimits, then (``run_as``, when the farm is root) the unprivileged host uid and
    gid the sandbox runs as, with no supplementary groups. Without a cgroup the process cap
    is RLIMIT_NPROC, which counts every task (thread) of the uid: the sandbox gets its budget
    on top of what the uid runs now (and root, whom RLIMIT_NPROC does not bind, needs the
    cgroup). That budget is shared by every sandbox of the uid: one that forks without end
    starves the others. With ``nproc_inside`` the sandbox sets its own cap instead, inside
    its user namespace, where the kernel (5.14+) counts only that namespace's tasks: a cap
    per sandbox."""
    uid = run_as[0] if run_as else os.geteuid()
    nproc = user_task_count(uid) + limits.processes
    procs_file = str(cgroup / "cgroup.procs") if cgroup is not None else None

    def run() -> None:
        os.setsid()
        if limits.nice:
            os.nice(limits.nice)
        if procs_file is not None:
            with open(procs_file, "w") as f:
                f.write(str(os.getpid()))
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


# The tool server starts in isolated mode (-I: no PYTHON* variables, no user site, neither
# the working directory nor a script's directory on sys.path), so nothing in a workspace
# (a sitecustomize.py, a ~/.local usercustomize, a .pth) runs inside it; its own import
# path comes as the first argument.
_BOOT = ("import runpy, sys; sys.path[:0] = [p for p in sys.argv.pop(1).split(':') if p]; "
         "sys.argv[0] = 'prorl_farm.sandbox.server'; "
         "runpy.run_module('prorl_farm.sandbox.server', run_name='__main__', alter_sys=True)")


def server_argv(socket: str | int, workspace: str, runtime_dir: str,
                python: str = sys.executable, ready_fd: int | None = None,
                pythonpath: str | None = None, nproc: int | None = None) -> list[str]:
    """The tool server's command line: ``socket`` is a path to bind, or the fd of a
    listening socket made by the host (:func:`listen_socket`); ``pythonpath``: where its
    packages are (default: the farm's own import path); ``nproc``: the process cap the
    server sets on itself (inside its own user namespace) before it starts anything."""
    import prorl_farm

    if pythonpath is None:
        pythonpath = str(Path(prorl_farm.__file__).resolve().parent.parent)
    where = (["--socket-fd", str(socket)] if isinstance(socket, int)
             else ["--socket", socket])
    ready = ["--ready-fd", str(ready_fd)] if ready_fd is not None else []
    ready += ["--nproc", str(nproc)] if nproc is not None else []
    return [python, "-I", "-c", _BOOT, pythonpath, *where, *ready,
            "--workspace", workspace, "--runtime-dir", runtime_dir]


# Where the farm's own package is bound inside a sandbox (read-only): only the package, not
# the checkout or install tree around it.
INSIDE_FARM = "/opt/prorl"


def _site_dirs() -> set[str]:
    return {os.path.realpath(p) for p in sys.path
            if p and "site-packages" in p and os.path.isdir(p)}


def usable_by(path: str, uid: int, gid: int) -> bool:
    """Whether ``uid``/``gid`` (without supplementary groups) can reach and execute
    ``path``: every directory on the way searchable, the file executable."""
    real = Path(os.path.realpath(path))
    for p in [*reversed(real.parents), real]:
        try:
            st = p.stat()
        except OSError:
            return False
        bit = 1  # x
        if st.st_uid == uid:
            ok = st.st_mode & (bit << 6)
        elif st.st_gid == gid:
            ok = st.st_mode & (bit << 3)
        else:
            ok = st.st_mode & bit
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class SandboxPython:
    """The interpreter the tool server runs with inside a sandbox, what to bind for it
    (host path, inside path; read-only) and the PYTHONPATH it needs there."""

    executable: str
    binds: tuple[tuple[str, str], ...]
    pythonpath: str


def sandbox_python(run_as: tuple[int, int] | None = None, python: str = "") -> SandboxPython:
    """The farm's interpreter, if the sandbox's uid can run it; else (a root farm whose
    Python lives under /root, say) ``python`` or the system's python3 of the same version,
    given the farm's site-packages on its path.

    Inside, everything of the farm's own sits under /opt/prorl (its package, its virtual
    environment, extra site directories), so no path of the host's checkout or install
    tree appears in a sandbox; only a base interpreter outside /usr keeps its own path (a
    virtual environment's ``home`` points there)."""
    import prorl_farm

    pkg = Path(prorl_farm.__file__).resolve().parent
    uid, gid = run_as if run_as else (os.geteuid(), os.getegid())
    chosen = python or sys.executable
    foreign = bool(python) and os.path.realpath(python) != os.path.realpath(sys.executable)
    if not python and run_as is not None and not usable_by(sys.executable, uid, gid):
        chosen, foreign = _system_python(), True
        if chosen is None:
            raise SandboxError(
                f"the sandbox uid {uid} cannot run {sys.executable} and no system python"
                f"{sys.version_info.major}.{sys.version_info.minor} exists: set "
                "PRORL_SANDBOX_PYTHON, or install the farm where that uid can read it")
    binds: list[tuple[str, str]] = [(str(pkg), f"{INSIDE_FARM}/prorl_farm")]
    covered: list[str] = []  # host trees already visible inside
    executable = chosen
    if not foreign:
        base = os.path.realpath(sys.base_prefix)
        venv = os.path.realpath(sys.prefix)
        if not base.startswith("/usr"):
            binds.append((base, base))
        covered.append(base)
        if venv != base:  # a virtual environment: anywhere, its python finds it
            binds.append((venv, f"{INSIDE_FARM}/venv"))
            covered.append(venv)
            executable = f"{INSIDE_FARM}/venv/bin/{os.path.basename(sys.executable)}"
    else:
        covered.append(os.path.dirname(os.path.dirname(os.path.realpath(chosen))))
    extra = [os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and os.path.isdir(p) and os.path.realpath(p) != str(pkg.parent)]
    wanted = sorted(_site_dirs()) + extra if foreign else extra
    pythonpath = [INSIDE_FARM]
    for n, host in enumerate(p for p in dict.fromkeys(wanted)
                             if not any(p == c or p.startswith(c.rstrip("/") + "/")
                                        for c in covered)):
        inside = f"{INSIDE_FARM}/path/{n}"
        binds.append((host, inside))
        pythonpath.append(inside)
    return SandboxPython(executable, tuple(binds), os.pathsep.join(pythonpath))


def _system_python() -> str | None:
    want = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/{want}", f"/usr/local/bin/{want}"):
        if os.path.exists(candidate):
            return candidate
    return None


def python_binds() -> list[tuple[str, str]]:
    """Read-only binds for the farm's interpreter inside an image runtime."""
    return list(sandbox_python().binds)
