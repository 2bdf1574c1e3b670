"""``apptainer``: Apptainer/Singularity images (``.sif`` or a directory), rootless, for HPC
clusters without Docker. No home or cwd mounts, a writable tmpfs, optional network
isolation; the tool server is bound in from the farm's own installation. Stopped like every
sandbox: SIGTERM to its process group, then SIGKILL."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from prorl_farm.sandbox.abstract import (
    IP_ENV,
    SANDBOX_ENV,
    Runtime,
    Sandbox,
    SandboxError,
    SandboxSpec,
)
from prorl_farm.sandbox.process import python_paths, server_argv

INSIDE_WORKSPACE = "/workspace"
INSIDE_RUN = "/run/prorl"


def apptainer_binary() -> str | None:
    return shutil.which("apptainer") or shutil.which("singularity")


def apptainer_argv(binary: str, spec: SandboxSpec, sandbox_id: str, workspace: Path,
                   run_dir: Path, ip: str, python: str) -> list[str]:
    """``apptainer exec`` of the tool server inside ``spec.image``."""
    if not spec.image:
        raise SandboxError("the apptainer runtime needs spec.image (a .sif file or directory)")
    argv = [binary, "exec", "--contain", "--cleanenv", "--no-home", "--writable-tmpfs",
            "--pid", "--ipc", "--pwd", INSIDE_WORKSPACE,
            "--bind", f"{workspace}:{INSIDE_WORKSPACE}", "--bind", f"{run_dir}:{INSIDE_RUN}"]
    if not spec.network:
        argv += ["--net", "--network", "none"]
    for path in python_paths():
        argv += ["--bind", f"{path}:{path}:ro"]
    env = {SANDBOX_ENV: sandbox_id, IP_ENV: ip, "HOME": INSIDE_WORKSPACE, **spec.env}
    for key, value in env.items():
        argv += ["--env", f"{key}={value}"]
    argv.append(spec.image)
    argv += server_argv(f"{INSIDE_RUN}/tools.sock", INSIDE_WORKSPACE, f"{INSIDE_RUN}/jupyter",
                        python=python)
    return argv


class ApptainerRuntime(Runtime):
    name = "apptainer"

    def __init__(self, sandbox_root: Path):
        self.sandbox_root = sandbox_root
        self.binary = apptainer_binary()
        if self.binary is None:
            raise SandboxError("neither apptainer nor singularity is on PATH")

    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, cgroup: Path | None) -> Sandbox:
        argv = apptainer_argv(self.binary, spec, sandbox_id, workspace, socket_path.parent, ip,
                              os.path.realpath(sys.executable))
        return self._launch(argv, {**os.environ, SANDBOX_ENV: sandbox_id}, spec, sandbox_id,
                            workspace, socket_path, ip, cgroup, INSIDE_WORKSPACE)
