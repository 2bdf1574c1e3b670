"""``bwrap``: bubblewrap, rootless. Own user, pid, ipc, uts and network namespaces; the
system read-only; home directories, /tmp, /run and other sandboxes hidden; a private
writable workspace; dies with its parent; rlimits, and a pids cgroup where the farm may
create one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from prorl_farm.sandbox.abstract import (
    INSIDE_RUN,
    INSIDE_WORKSPACE,
    IP_ENV,
    SANDBOX_ENV,
    Runtime,
    Sandbox,
    SandboxError,
    SandboxSpec,
)
from prorl_farm.sandbox.process import python_paths, server_argv

MASKED = ("/tmp", "/root", "/home", "/run", "/var/tmp")
NOT_BOUND = {"proc", "dev", "lost+found", INSIDE_WORKSPACE.strip("/")}


def bwrap_argv(spec: SandboxSpec, sandbox_id: str, workspace: Path, run_dir: Path, ip: str,
               sandbox_root: Path, bwrap: str = "bwrap") -> list[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": "C.UTF-8",
           "HOME": INSIDE_WORKSPACE, SANDBOX_ENV: sandbox_id, IP_ENV: ip, **spec.env}
    if os.environ.get("PYTHONPATH"):  # the tool server's own imports, when set that way
        env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session",
            "--hostname", f"sandbox-{sandbox_id[:8]}", "--clearenv"]
    if not spec.network:
        argv.append("--unshare-net")  # only a loopback interface inside
    # The system read-only, one top-level directory at a time on bwrap's own root, so that
    # the root itself stays a tmpfs where /workspace can be made.
    for name in sorted(os.listdir("/")):
        path = "/" + name
        if name in NOT_BOUND or path in MASKED:
            continue
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    for path in MASKED + (str(sandbox_root),):
        argv += ["--tmpfs", path]
    # The interpreter and packages the tool server needs, wherever they live.
    for path in python_paths():
        argv += ["--ro-bind", path, path]
    argv += ["--bind", str(workspace), INSIDE_WORKSPACE, "--bind", str(run_dir), INSIDE_RUN,
             "--chdir", INSIDE_WORKSPACE]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv


class BwrapRuntime(Runtime):
    name = "bwrap"

    def __init__(self, sandbox_root: Path):
        self.sandbox_root = sandbox_root
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxError("bubblewrap (bwrap) is not installed")

    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, cgroup: Path | None) -> Sandbox:
        argv = bwrap_argv(spec, sandbox_id, workspace, socket_path.parent, ip,
                          self.sandbox_root, self.bwrap)
        argv += ["--"] + server_argv(f"{INSIDE_RUN}/{socket_path.name}", INSIDE_WORKSPACE,
                                     f"{INSIDE_RUN}/jupyter")
        return self._launch(argv, {SANDBOX_ENV: sandbox_id}, spec, sandbox_id, workspace,
                            socket_path, ip, cgroup, INSIDE_WORKSPACE)
