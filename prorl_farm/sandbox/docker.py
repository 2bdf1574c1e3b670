"""``docker``: optional, same contract. The container runs the farm's own interpreter and
packages, bound in read-only, with no network unless asked; stopped with ``docker kill``
after the usual SIGTERM/SIGKILL of the client process group."""

from __future__ import annotations

import os
import shutil
import subprocess
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


def docker_argv(binary: str, spec: SandboxSpec, sandbox_id: str, workspace: Path,
                run_dir: Path, ip: str, python: str) -> list[str]:
    if not spec.image:
        raise SandboxError("the docker runtime needs spec.image")
    lim = spec.limits
    argv = [binary, "run", "--rm", "--init", "--name", f"prorl-{sandbox_id}",
            "--pids-limit", str(lim.processes), "--memory", str(lim.address_space_bytes),
            "--ulimit", f"fsize={lim.file_size_bytes}", "--ulimit", f"cpu={lim.cpu_s}",
            "-v", f"{workspace}:{INSIDE_WORKSPACE}", "-v", f"{run_dir}:{INSIDE_RUN}",
            "-w", INSIDE_WORKSPACE]
    if not spec.network:
        argv += ["--network", "none"]
    for path in python_paths():
        argv += ["-v", f"{path}:{path}:ro"]
    for key, value in {SANDBOX_ENV: sandbox_id, IP_ENV: ip, "HOME": INSIDE_WORKSPACE,
                       **spec.env}.items():
        argv += ["-e", f"{key}={value}"]
    argv.append(spec.image)
    argv += server_argv(f"{INSIDE_RUN}/tools.sock", INSIDE_WORKSPACE, f"{INSIDE_RUN}/jupyter",
                        python=python)
    return argv


class DockerRuntime(Runtime):
    name = "docker"

    def __init__(self, sandbox_root: Path):
        self.sandbox_root = sandbox_root
        self.binary = shutil.which("docker")
        if self.binary is None:
            raise SandboxError("docker is not on PATH")

    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, cgroup: Path | None) -> Sandbox:
        argv = docker_argv(self.binary, spec, sandbox_id, workspace, socket_path.parent, ip,
                           os.path.realpath(sys.executable))
        return self._launch(argv, {**os.environ, SANDBOX_ENV: sandbox_id}, spec, sandbox_id,
                            workspace, socket_path, ip, cgroup, INSIDE_WORKSPACE)

    def stop(self, sandbox: Sandbox, grace_s: float = 2.0) -> None:
        subprocess.run([self.binary, "kill", f"prorl-{sandbox.id}"], capture_output=True,
                       timeout=30)
        super().stop(sandbox, grace_s)
