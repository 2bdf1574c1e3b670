"""``docker``: a container per sandbox, on the node's Docker engine (``DOCKER_HOST``).

What a sandbox sees: the image's filesystem, read-only, with a private writable
``/workspace``, fresh ``/tmp``, ``/var/tmp`` and ``/run`` (memory), the farm's interpreter and
packages bound in read-only (as in ``bwrap``), and nothing else of the host; no network
unless asked (``--network none``: a loopback only).

Who runs it: an unprivileged uid (the sandbox user, ``nobody`` when the farm is root; the
farm's own uid otherwise), no capabilities, ``no-new-privileges`` (no setuid), its own pid,
ipc, uts and mount namespaces, a pids and a memory cap, a low CPU weight. The engine's
seccomp and AppArmor profiles and its masks over ``/proc`` are off, as they are for a
``bwrap`` sandbox on the host: a grader must be able to jail the code under test in a user
namespace with a ``/proc`` of its own (``graders/jail.py``), which they forbid. Without the
jail the code under test could signal the grader that runs it (same uid) and turn its zero
into a failure.

The tool server is pid 1 of the container's pid namespace (no ``--init``): as under
``bwrap --as-pid-1``, nothing inside can signal it but with the signals it handles, and it is
not dumpable. Its socket is bound inside the run directory; readiness comes back through a
FIFO there (a container inherits no fd). Stopped with ``docker kill`` (``--rm`` removes it),
then the usual SIGTERM/SIGKILL of the client process group.

A container outlives its client, which dies with the worker that started it (as a ``bwrap``
sandbox does). So that the container does too, the client holds the host end of a second
FIFO, the lifeline: the tool server opens it, unlinks it (nothing inside can hold it), and
stops at its EOF. A janitor is not needed to end the sandboxes of a worker that is gone.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import subprocess
from pathlib import Path

from prorl_farm.sandbox.abstract import (
    DISK_SCRATCH,
    Limits,
    Sandbox,
    SandboxSpec,
    chown_tree,
    disk_scratch,
    gateway_dir,
)
from prorl_farm.sandbox.interpreter import python_binds, sandbox_python
from prorl_farm.sandbox.runtimes.image import ImageRuntime, inside_env, inside_server
from prorl_farm.toolserver.protocol import (
    INSIDE_GATEWAY_DIR,
    INSIDE_HARNESSES,
    INSIDE_RUN,
    INSIDE_WORKSPACE,
)

NOBODY = (65534, 65534)
READY = "ready.fifo"  # in the run directory
LIFELINE = "lifeline.fifo"  # in the run directory: the container ends at its EOF
# The client process (`docker run`) is not the sandbox: the spec's limits are the
# container's, and a Go client under an address-space cap may not start.
_INF = resource.RLIM_INFINITY
CLIENT_LIMITS = Limits(cpu_s=_INF, address_space_bytes=_INF, file_size_bytes=_INF,
                       processes=256, nice=0)
# The containers' CPU weight (the engine's default is 1024): below the farm's own processes,
# as a bwrap sandbox's nice value puts it.
CPU_SHARES = 128


def docker_argv(binary: str, spec: SandboxSpec, sandbox_id: str, workspace: Path,
                run_dir: Path, ip: str, python: str, user: tuple[int, int] = NOBODY,
                image: str = "", ready: str | None = None, root_mask: Path | None = None,
                lifeline: str | None = None) -> list[str]:
    image_name, command, *args = inside_server(spec, python, ready, image, lifeline,
                                               tuple(DISK_SCRATCH))
    lim = spec.limits
    argv = [binary, "run", "--rm", "--name", f"prorl-{sandbox_id}",
            "--label", f"prorl.sandbox={sandbox_id}",
            "--user", f"{user[0]}:{user[1]}", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--security-opt", "seccomp=unconfined",
            "--security-opt", "apparmor=unconfined", "--security-opt",
            "systempaths=unconfined", "--read-only",
            "--tmpfs", f"/run:mode=0755,size={lim.scratch_bytes}", "--ipc", "private",
            "--shm-size", str(lim.scratch_bytes),
            "--hostname", f"sandbox-{sandbox_id[:8]}",
            "--pids-limit", str(lim.processes), "--memory", str(lim.address_space_bytes),
            "--ulimit", f"fsize={lim.file_size_bytes}", "--ulimit", f"cpu={lim.cpu_s}",
            "--ulimit", f"nofile={lim.open_files}", "--ulimit", "core=0",
            "--cpu-shares", str(CPU_SHARES),
            "-v", f"{workspace}:{INSIDE_WORKSPACE}", "-v", f"{run_dir}:{INSIDE_RUN}",
            *(x for inside, host in disk_scratch(workspace).items()
              for x in ("-v", f"{host}:{inside}")),
            "-w", INSIDE_WORKSPACE, "--entrypoint", command]
    if not spec.network:
        argv += ["--network", "none"]
    if root_mask is not None:
        argv += ["-v", f"{root_mask}:/root"]
    if spec.gateway:  # the directory where the job's gateway puts its socket
        argv += ["-v", f"{gateway_dir(workspace)}:{INSIDE_GATEWAY_DIR}"]
        if spec.harnesses and os.path.isdir(spec.harnesses):
            argv += ["-v", f"{spec.harnesses}:{INSIDE_HARNESSES}:ro"]
    for host, inside in python_binds():
        argv += ["-v", f"{host}:{inside}:ro"]
    for inside, host in sorted(spec.ro_paths.items()):
        argv += ["-v", f"{host}:{inside}:ro"]
    for key, value in inside_env(spec, sandbox_id, ip).items():
        argv += ["-e", f"{key}={value}"]
    return argv + [image_name, *args]


def root_mask(sandbox_root: Path, insides: list[str]) -> Path | None:
    """Where the farm's interpreter is bound under /root (a root farm's pyenv, say), the
    image's /root (0700) keeps the sandbox's uid from it: a directory of the host's instead,
    root's, 0755 and empty but for the mount points of those binds (made here: the engine
    would make them at each start). None where no bind is under /root."""
    under = [inside for inside in insides if inside.startswith("/root/")]
    if not under:
        return None
    mask = sandbox_root / ".root"
    for inside in under:
        (mask / inside[len("/root/"):]).mkdir(parents=True, exist_ok=True)
    for dirpath, _, _ in os.walk(mask):
        os.chmod(dirpath, 0o755)
    return mask


class DockerRuntime(ImageRuntime):
    name = "docker"
    serves_gateway = True
    binaries = ("docker",)

    @classmethod
    def from_options(cls, options) -> DockerRuntime:
        return cls(options.sandbox_root, options.image, options.run_as)

    def __init__(self, sandbox_root: Path, image: str = "",
                 run_as: tuple[int, int] | None = None):
        super().__init__(sandbox_root, image)
        self.run_as = run_as
        if os.geteuid() != 0:
            self.user = (os.geteuid(), os.getegid())  # its files: the farm's own
        else:
            self.user = run_as or NOBODY  # never root inside, whatever the image says
        self.root_mask = root_mask(sandbox_root, [inside for _, inside in python_binds()])

    def argv(self, spec, sandbox_id, workspace, run_dir, ip, python, ready_fd=None
             ) -> list[str]:
        return docker_argv(self.binary, spec, sandbox_id, workspace, run_dir, ip, python,
                           self.user, self.image, f"{INSIDE_RUN}/{READY}", self.root_mask,
                           f"{INSIDE_RUN}/{LIFELINE}")

    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, cgroup: Path | None) -> Sandbox:
        run_dir = socket_path.parent
        fifo, lifeline = run_dir / READY, run_dir / LIFELINE
        for path in (fifo, lifeline):
            os.mkfifo(path, 0o600)
        if os.geteuid() == 0:
            if self.run_as is None:  # else the manager gave the workspace to run_as already
                chown_tree(workspace, *self.user)
            for path in (run_dir, fifo, lifeline):
                os.lchown(path, *self.user)
        python = sandbox_python().executable

        def argv(_sock, _ready_fd):
            return self.argv(spec, sandbox_id, workspace, run_dir, ip, python)

        # The client holds the lifeline's host end (it dies with the worker that started
        # it); this process lets go of it once the client has it.
        hold = os.open(lifeline, os.O_RDWR)
        try:
            # The pids and memory caps are the container's (the engine's cgroup), not the
            # client process's.
            return self._launch(argv, dict(os.environ),
                                dataclasses.replace(spec, limits=CLIENT_LIMITS), sandbox_id,
                                workspace, socket_path, ip, None, INSIDE_WORKSPACE,
                                pass_socket=False, ready_fifo=fifo, keep_fds=(hold,))
        finally:
            os.close(hold)

    def stop(self, sandbox: Sandbox, grace_s: float = 2.0) -> None:
        subprocess.run([self.binary, "kill", f"prorl-{sandbox.id}"], capture_output=True,
                       timeout=30)
        super().stop(sandbox, grace_s)
