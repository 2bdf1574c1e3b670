"""The tool server's interpreter inside a sandbox and its command line: which Python (the
farm's, or the system's where the sandbox user cannot run the farm's), what to bind for it,
and the argv that boots ``prorl_farm.toolserver.server`` in isolated mode."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from prorl_farm.errors import SandboxError
from prorl_farm.toolserver.protocol import INSIDE_FARM

# The tool server starts in isolated mode (-I: no PYTHON* variables, no user site, neither
# the working directory nor a script's directory on sys.path), so nothing in a workspace
# (a sitecustomize.py, a ~/.local usercustomize, a .pth) runs inside it; its own import
# path comes as the first argument.
_BOOT = ("import runpy, sys; sys.path[:0] = [p for p in sys.argv.pop(1).split(':') if p]; "
         "sys.argv[0] = 'prorl_farm.toolserver.server'; "
         "runpy.run_module('prorl_farm.toolserver.server', run_name='__main__', alter_sys=True)")


def server_argv(socket: str | int, workspace: str, runtime_dir: str,
                python: str = sys.executable, ready_fd: int | str | None = None,
                pythonpath: str | None = None, nproc: int | None = None,
                gateway: str | None = None, lifeline: str | None = None,
                workspace_mb: int | None = None,
                measured: tuple[str, ...] = ()) -> list[str]:
    """The tool server's command line: ``socket`` is a path to bind, or the fd of a
    listening socket made by the host (:func:`listen_socket`); ``pythonpath``: where its
    packages are (default: the farm's own import path); ``nproc``: the process cap the
    server sets on itself (inside its own user namespace) before it starts anything;
    ``ready_fd``: the readiness pipe's fd, or the path of a FIFO (containers);
    ``lifeline``: a FIFO whose EOF (its host end closed) stops the server (containers);
    ``workspace_mb``: the workspace's size limit as a whole, which the server holds it to,
    with the directories ``measured`` (the sandbox's /tmp and /var/tmp) counted in it."""
    import prorl_farm

    if pythonpath is None:
        pythonpath = str(Path(prorl_farm.__file__).resolve().parent.parent)
    where = (["--socket-fd", str(socket)] if isinstance(socket, int)
             else ["--socket", socket])
    ready = ([] if ready_fd is None else ["--ready-path", ready_fd]
             if isinstance(ready_fd, str) else ["--ready-fd", str(ready_fd)])
    ready += ["--nproc", str(nproc)] if nproc is not None else []
    ready += ["--gateway", gateway] if gateway else []
    ready += ["--lifeline", lifeline] if lifeline else []
    ready += ["--workspace-mb", str(workspace_mb)] if workspace_mb else []
    for path in measured if workspace_mb else ():
        ready += ["--measure-also", path]
    return [python, "-I", "-c", _BOOT, pythonpath, *where, *ready,
            "--workspace", workspace, "--runtime-dir", runtime_dir]


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
