"""``local``: the tool server as a plain subprocess in its own session. No isolation: for
development only. Limits still apply."""

from __future__ import annotations

import os
from pathlib import Path

from prorl_farm.sandbox.abstract import Runtime, Sandbox, SandboxSpec
from prorl_farm.sandbox.interpreter import server_argv
from prorl_farm.toolserver.protocol import IP_ENV, SANDBOX_ENV


class LocalRuntime(Runtime):
    name = "local"

    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, cgroup: Path | None) -> Sandbox:
        env = {**os.environ, **spec.env, SANDBOX_ENV: sandbox_id, IP_ENV: ip,
               "HOME": str(workspace)}
        runtime_dir = str(socket_path.parent / "jupyter")

        def argv(sock, ready_fd):
            return server_argv(sock, str(workspace), runtime_dir, ready_fd=ready_fd,
                               workspace_mb=spec.limits.workspace_mb)

        return self._launch(argv, env, spec, sandbox_id, workspace, socket_path, ip, cgroup,
                            str(workspace), cwd=str(workspace))
