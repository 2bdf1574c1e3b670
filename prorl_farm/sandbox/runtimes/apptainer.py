"""``apptainer``: Apptainer/Singularity images (``.sif`` or a directory), rootless, for HPC
clusters without Docker. No home or cwd mounts, a writable tmpfs, optional network
isolation; the tool server is bound in from the farm's own installation. Stopped like every
sandbox: SIGTERM to its process group, then SIGKILL."""

from __future__ import annotations

from pathlib import Path

from prorl_farm.sandbox.abstract import SandboxSpec
from prorl_farm.sandbox.interpreter import python_binds
from prorl_farm.sandbox.runtimes.image import ImageRuntime, inside_env, inside_server
from prorl_farm.toolserver.protocol import INSIDE_RUN, INSIDE_WORKSPACE


def apptainer_argv(binary: str, spec: SandboxSpec, sandbox_id: str, workspace: Path,
                   run_dir: Path, ip: str, python: str, ready_fd: int | None = None,
                   image: str = "") -> list[str]:
    """``apptainer exec`` of the tool server inside ``spec.image`` (else ``image``; it
    inherits the readiness pipe)."""
    tail = inside_server(spec, python, ready_fd, image)
    argv = [binary, "exec", "--contain", "--cleanenv", "--no-home", "--writable-tmpfs",
            "--pid", "--ipc", "--pwd", INSIDE_WORKSPACE,
            "--bind", f"{workspace}:{INSIDE_WORKSPACE}", "--bind", f"{run_dir}:{INSIDE_RUN}"]
    if not spec.network:
        argv += ["--net", "--network", "none"]
    for host, inside in python_binds():
        argv += ["--bind", f"{host}:{inside}:ro"]
    for key, value in inside_env(spec, sandbox_id, ip).items():
        argv += ["--env", f"{key}={value}"]
    return argv + tail


class ApptainerRuntime(ImageRuntime):
    name = "apptainer"
    binaries = ("apptainer", "singularity")

    def argv(self, spec, sandbox_id, workspace, run_dir, ip, python, ready_fd=None
             ) -> list[str]:
        return apptainer_argv(self.binary, spec, sandbox_id, workspace, run_dir, ip, python,
                              ready_fd, self.image)
