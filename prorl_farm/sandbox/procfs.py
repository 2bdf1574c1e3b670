"""A full ``/proc`` for bubblewrap in a container that masks parts of its own.

Docker masks parts of a container's ``/proc`` (``kcore``, ``keys``, ``timer_list``, ...) by
mounting over them. The kernel lets a user namespace mount a fresh ``proc`` (what bubblewrap
does for every sandbox's own pid namespace) only where some ``proc`` of the mount namespace
is fully visible, so in such a container every sandbox fails to start ("Can't mount proc on
/newroot/proc"). ``docker run --security-opt systempaths=unconfined`` unmasks it, but Debian's
docker-compose (v1) cannot ask for that.

``worker --mount-proc STAGE`` does it in the pool's container instead: with CAP_SYS_ADMIN
(compose: ``cap_add``), mount a fresh ``proc`` at :data:`FULL_PROC` (no sandbox sees it: a
sandbox's ``/run`` is its own), then drop that capability from every set for good
(``setpriv``) before the pool runs.
"""

from __future__ import annotations

import os
import subprocess

from prorl_farm.errors import SandboxError

FULL_PROC = "/run/prorl-proc"


class ProcMountError(SandboxError):
    """The full proc could not be mounted (no CAP_SYS_ADMIN)."""


def mount_full_proc(where: str = FULL_PROC) -> None:
    os.makedirs(where, mode=0o700, exist_ok=True)
    if os.path.ismount(where):
        return
    out = subprocess.run(["mount", "-t", "proc", "proc", where], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise ProcMountError(
            f"--mount-proc: cannot mount a proc at {where} ({out.stderr.strip()}): the "
            "container needs CAP_SYS_ADMIN (compose: cap_add: [SYS_ADMIN]; the pool drops it "
            "before it starts)")


def exec_without_sys_admin(argv: list[str]) -> None:
    """Replace this process by ``argv`` with CAP_SYS_ADMIN out of its bounding and
    inheritable sets (so out of every set after the exec); does not return."""
    os.execvp("setpriv", ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin",
                          "--", *argv])
