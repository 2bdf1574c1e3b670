"""``bwrap``: bubblewrap, rootless, least visibility.

What a sandbox sees: an allow-list, never the host minus a deny-list. The system's programs
and libraries (``/usr`` and the merged-``/usr`` links ``/bin``, ``/lib*``, ``/sbin``); a
curated ``/etc`` (what programs need to run: loader cache, certificates, time zone, name
service config; never ``shadow``, ``gshadow``, ``sudoers`` or ssh keys) with a ``passwd``
and ``group`` of the sandbox's own; the interpreter and packages the tool server needs, and
of the farm only its package, at /opt/prorl; read-only paths the operator adds; a private
writable ``/workspace``; fresh ``/tmp``, ``/var/tmp``, ``/run``, ``/dev`` and ``/proc``.
Nothing of the farm's run directory, the project checkout, home directories or other
sandboxes.

Who runs it: own user, pid, ipc, uts, cgroup and network namespaces (only a loopback
inside); every process inside is uid/gid 1000 ("agent") with no capabilities; when the
farm runs as root, the whole sandbox runs as an unprivileged host uid (PRORL_SANDBOX_USER,
default nobody), so root-only host files stay unreadable whatever is bound.

The tool server is pid 1 of the sandbox's pid namespace: the kernel delivers no signal to
it from inside but those it handles, and it handles none (SIGKILL and SIGSTOP from inside
never reach an init); it is not dumpable, so nothing inside can ptrace it or read its
memory or fds; its listening socket was made on the host and passed in as an fd, so no
path inside leads to it. Whatever the agent kills, the tool server answers and says so.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from prorl_farm.sandbox.abstract import (
    DISK_SCRATCH,
    Runtime,
    Sandbox,
    SandboxError,
    SandboxSpec,
    disk_scratch,
    gateway_dir,
    gateway_env,
    gateway_relay,
)
from prorl_farm.sandbox.interpreter import SandboxPython, sandbox_python, server_argv
from prorl_farm.toolserver.protocol import (
    INSIDE_GATEWAY_DIR,
    INSIDE_HARNESSES,
    INSIDE_RUN,
    INSIDE_WORKSPACE,
    IP_ENV,
    SANDBOX_ENV,
)

# The identity of every process inside (mapped to the host uid the sandbox runs as).
INSIDE_UID = 1000
INSIDE_GID = 1000
# Top-level paths bound read-only where they exist (merged /usr: /bin, /lib*, /sbin are
# links into /usr and are recreated as links).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# What of /etc a program may need, bound read-only where it exists. Never shadow files,
# sudoers, ssh keys and configuration, or anything else not listed.
ETC_ALLOW = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf",
    "debian_version", "fonts", "gai.conf", "host.conf", "hosts", "inputrc", "ld.so.cache",
    "ld.so.conf", "ld.so.conf.d", "locale.alias", "localtime", "magic", "magic.mime",
    "mime.types", "netconfig", "networks", "nsswitch.conf", "os-release", "profile",
    "protocols", "python3", f"python3.{sys.version_info.minor}", "resolv.conf",
    "services", "shells", "ssl", "terminfo", "timezone", "xml",
)
# Inside an allowed /etc entry, masked all the same.
ETC_MASK = ("ssl/private",)
PASSWD = (f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
          f"agent:x:{INSIDE_UID}:{INSIDE_GID}:agent:{INSIDE_WORKSPACE}:/bin/bash\n"
          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
GROUP = f"root:x:0:\nagent:x:{INSIDE_GID}:\nnogroup:x:65534:\n"


def identity_files(root: Path) -> Path:
    """The sandboxes' own ``passwd`` and ``group`` (shared, read-only inside)."""
    etc = root / ".etc"
    etc.mkdir(exist_ok=True)
    for name, text in (("passwd", PASSWD), ("group", GROUP)):
        path = etc / name
        if not path.exists() or path.read_text() != text:
            tmp = etc / f".{name}.{os.getpid()}"
            tmp.write_text(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
    os.chmod(etc, 0o755)
    return etc


def _ro(argv: list[str], host: str, inside: str) -> None:
    if os.path.islink(host) and os.path.dirname(inside) == "/":
        argv += ["--symlink", os.readlink(host), inside]
    elif os.path.exists(host):
        argv += ["--ro-bind", host, inside]


def bwrap_argv(spec: SandboxSpec, sandbox_id: str, workspace: Path, ip: str,
               identity: Path, python: SandboxPython, ro_paths: dict[str, str] | None = None,
               bwrap: str = "bwrap") -> list[str]:
    """The bwrap command line, up to (not including) ``--`` and the command."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": INSIDE_WORKSPACE,
           "USER": "agent", "LOGNAME": "agent", SANDBOX_ENV: sandbox_id, IP_ENV: ip}
    if spec.gateway:  # the harness's SDKs find the job's model gateway here
        env.update(gateway_env(ip))
    env.update(spec.env)
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_GID),
            "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--as-pid-1",
            "--hostname", f"sandbox-{sandbox_id[:8]}", "--clearenv"]
    if not spec.network:
        argv.append("--unshare-net")  # only a loopback interface inside
    for path in SYSTEM:
        _ro(argv, path, path)
    argv += ["--tmpfs", "/etc"]
    for name in ETC_ALLOW:
        _ro(argv, f"/etc/{name}", f"/etc/{name}")
    for name in ETC_MASK:
        if os.path.isdir(f"/etc/{name}"):
            argv += ["--tmpfs", f"/etc/{name}"]
    argv += ["--ro-bind", str(identity / "passwd"), "/etc/passwd",
             "--ro-bind", str(identity / "group"), "/etc/group", "--remount-ro", "/etc"]
    size = str(spec.limits.scratch_bytes)  # every tmpfs bounded: it is the node's memory
    argv += ["--dev", "/dev", "--proc", "/proc"]
    for scratch in ("/dev/shm", "/run"):
        argv += ["--size", size, "--tmpfs", scratch]
    for inside, host in disk_scratch(workspace).items():  # on disk, beside the workspace
        argv += ["--bind", str(host), inside]
    argv += ["--dir", INSIDE_RUN]
    if spec.gateway:  # the directory where the job's gateway puts its socket
        argv += ["--bind", str(gateway_dir(workspace)), INSIDE_GATEWAY_DIR]
        if spec.harnesses and os.path.isdir(spec.harnesses):
            argv += ["--ro-bind", spec.harnesses, INSIDE_HARNESSES]
    for host, inside in python.binds:
        argv += ["--ro-bind", host, inside]
    for inside, host in sorted((ro_paths or {}).items()):
        argv += ["--ro-bind", host, inside]
    argv += ["--bind", str(workspace), INSIDE_WORKSPACE, "--chdir", INSIDE_WORKSPACE,
             # Nothing writable but the workspace, /tmp, /var/tmp and the fresh /run.
             "--remount-ro", "/"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv


class BwrapRuntime(Runtime):
    name = "bwrap"
    serves_gateway = True

    @classmethod
    def from_options(cls, options) -> BwrapRuntime:
        return cls(options.sandbox_root, options.run_as, options.python, options.ro_paths)

    def __init__(self, sandbox_root: Path, run_as: tuple[int, int] | None = None,
                 python: str = "", ro_paths: dict[str, str] | None = None):
        self.sandbox_root = sandbox_root
        self.run_as = run_as
        self.ro_paths = dict(ro_paths or {})
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxError("bubblewrap (bwrap) is not installed")
        self.python = sandbox_python(run_as, python)
        self.identity = identity_files(sandbox_root)

    def start(self, spec: SandboxSpec, sandbox_id: str, workspace: Path, socket_path: Path,
              ip: str, cgroup: Path | None) -> Sandbox:
        ro_paths = {**self.ro_paths, **spec.ro_paths}
        base = bwrap_argv(spec, sandbox_id, workspace, ip, self.identity, self.python,
                          ro_paths, self.bwrap)

        def argv(sock, ready_fd):
            gateway = gateway_relay() if spec.gateway else None
            return base + ["--"] + server_argv(sock, INSIDE_WORKSPACE, f"{INSIDE_RUN}/jupyter",
                                               python=self.python.executable,
                                               ready_fd=ready_fd,
                                               pythonpath=self.python.pythonpath,
                                               nproc=None if cgroup else spec.limits.processes,
                                               gateway=gateway,
                                               workspace_mb=spec.limits.workspace_mb,
                                               measured=tuple(DISK_SCRATCH))

        # Without a pids cgroup, the cap is set inside the sandbox's own user namespace (a
        # cap per sandbox), not on the host uid that every sandbox shares.
        return self._launch(argv, {SANDBOX_ENV: sandbox_id}, spec, sandbox_id, workspace,
                            socket_path, ip, cgroup, INSIDE_WORKSPACE, run_as=self.run_as,
                            nproc_inside=cgroup is None)
