"""``docker``: optional, same contract. The container runs the farm's own interpreter and
packages, bound in read-only, with no network unless asked; stopped with ``docker kill``
after the usual SIGTERM/SIGKILL of the client process group."""

from __future__ import annotations

import subprocess
from pathlib import Path

from prorl_farm.sandbox.abstract import INSIDE_RUN, INSIDE_WORKSPACE, Sandbox, SandboxSpec
from prorl_farm.sandbox.interpreter import python_binds
from prorl_farm.sandbox.runtimes.image import ImageRuntime, inside_env, inside_server


def docker_argv(binary: str, spec: SandboxSpec, sandbox_id: str, workspace: Path,
                run_dir: Path, ip: str, python: str) -> list[str]:
    tail = inside_server(spec, python)
    lim = spec.limits
    argv = [binary, "run", "--rm", "--init", "--name", f"prorl-{sandbox_id}",
            "--pids-limit", str(lim.processes), "--memory", str(lim.address_space_bytes),
            "--ulimit", f"fsize={lim.file_size_bytes}", "--ulimit", f"cpu={lim.cpu_s}",
            "-v", f"{workspace}:{INSIDE_WORKSPACE}", "-v", f"{run_dir}:{INSIDE_RUN}",
            "-w", INSIDE_WORKSPACE]
    if not spec.network:
        argv += ["--network", "none"]
    for host, inside in python_binds():
        argv += ["-v", f"{host}:{inside}:ro"]
    for key, value in inside_env(spec, sandbox_id, ip).items():
        argv += ["-e", f"{key}={value}"]
    return argv + tail


class DockerRuntime(ImageRuntime):
    name = "docker"
    binaries = ("docker",)

    def argv(self, spec, sandbox_id, workspace, run_dir, ip, python, ready_fd=None
             ) -> list[str]:
        # A container cannot inherit the readiness pipe: readiness is the socket appearing.
        return docker_argv(self.binary, spec, sandbox_id, workspace, run_dir, ip, python)

    def stop(self, sandbox: Sandbox, grace_s: float = 2.0) -> None:
        subprocess.run([self.binary, "kill", f"prorl-{sandbox.id}"], capture_output=True,
                       timeout=30)
        super().stop(sandbox, grace_s)
