"""What the image-based runtimes (apptainer, docker) share: the environment and the tool
server command inside the image, the binary lookup, and start."""

from __future__ import annotations

import os
from pathlib import Path

from prorl_farm.sandbox.abstract import (
    Runtime,
    Sandbox,
    SandboxError,
    SandboxSpec,
    gateway_env,
    gateway_relay,
)
from prorl_farm.sandbox.interpreter import sandbox_python, server_argv
from prorl_farm.toolserver.protocol import INSIDE_RUN, INSIDE_WORKSPACE, IP_ENV, SANDBOX_ENV


def inside_env(spec: SandboxSpec, sandbox_id: str, ip: str) -> dict[str, str]:
    gateway = gateway_env(ip) if spec.gateway else {}
    return {SANDBOX_ENV: sandbox_id, IP_ENV: ip, "HOME": INSIDE_WORKSPACE, **gateway,
            **spec.env}


def inside_server(spec: SandboxSpec, python: str, ready_fd: int | str | None = None,
                  image: str = "", lifeline: str | None = None,
                  measured: tuple[str, ...] = ()) -> list[str]:
    """The image (the spec's, else ``image``: the node's), then the tool server run by the
    farm's own (bound-in) interpreter (with the gateway's relay where the spec asks for
    it)."""
    image = spec.image or image
    if not image:
        raise SandboxError("this runtime needs an image: the instance's, or the node's "
                           "PRORL_SANDBOX_IMAGE")
    return [image, *server_argv(f"{INSIDE_RUN}/tools.sock", INSIDE_WORKSPACE,
                                f"{INSIDE_RUN}/jupyter", python=python, ready_fd=ready_fd,
                                pythonpath=sandbox_python().pythonpath,
                                gateway=gateway_relay() if spec.gateway else None,
                                lifeline=lifeline, workspace_mb=spec.limits.workspace_mb,
                                measured=measured)]


class ImageRuntime(Runtime):
    """A runtime that runs ``argv(...)`` (a container command line) in the foreground."""

    binaries: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, options) -> ImageRuntime:
        return cls(options.sandbox_root, options.image)

    def __init__(self, sandbox_root: Path, image: str = ""):
        import shutil

        self.sandbox_root = sandbox_root
        self.image = image  # for specs that name none
        self.binary = next(filter(None, map(shutil.which, self.binaries)), None)
        if self.binary is None:
            raise SandboxError(f"none of {', '.join(self.binaries)} is on PATH")

    def argv(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, run_dir: Path,
             ip: str, python: str, ready_fd: int | None = None) -> list[str]:
        raise NotImplementedError

    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, cgroup: Path | None) -> Sandbox:
        python = sandbox_python().executable

        def argv(_sock, ready_fd):
            return self.argv(spec, sandbox_id, workspace, socket_path.parent, ip, python,
                             ready_fd)

        return self._launch(argv, {**os.environ, SANDBOX_ENV: sandbox_id}, spec, sandbox_id,
                            workspace, socket_path, ip, cgroup, INSIDE_WORKSPACE,
                            pass_socket=False)
