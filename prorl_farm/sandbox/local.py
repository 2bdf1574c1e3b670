"""``local``: the tool server as a plain subprocess in its own session. No isolation: for
development only. Limits still apply."""

from __future__ import annotations

import os
from pathlib import Path

from prorl_farm.sandbox.abstract import IP_ENV, SANDBOX_ENV, Runtime, Sandbox, SandboxSpec
from prorl_farm.sandbox.process import server_argv, spawn, wait_ready


class LocalRuntime(Runtime):
    name = "local"

    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, cgroup: Path | None) -> Sandbox:
        run_dir = socket_path.parent
        env = {**os.environ, **spec.env, SANDBOX_ENV: sandbox_id, IP_ENV: ip,
               "HOME": str(workspace)}
        log = run_dir / "server.log"
        proc = spawn(server_argv(str(socket_path), str(workspace), str(run_dir / "jupyter")),
                     env, spec.limits, cgroup, log, cwd=str(workspace))
        sandbox = Sandbox(sandbox_id, self.name, "", proc.pid, str(workspace), str(socket_path),
                          ip, str(cgroup or ""), str(workspace))
        self._track(sandbox_id, proc)
        try:
            wait_ready(proc, socket_path, spec.start_timeout_s, log)
        except Exception:
            self.stop(sandbox, grace_s=0)
            raise
        return sandbox
