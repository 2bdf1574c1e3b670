"""A pids cgroup per sandbox, where this process may create one (root, or a delegated
subtree): the only process cap that holds for a farm running as root, since RLIMIT_NPROC
does not apply to uid 0. Also lists and kills everything in the sandbox.

And a CPU group per tenant (cgroup v1's ``cpu`` controller, ``cpu.shares`` = 1024 times the
tenant's weight), which the processes a node starts for a tenant's jobs join (its sandboxes,
graders' among them, and the answer-grading helpers while they grade for it): when the
node's CPUs are contended, each tenant's work gets CPU by its weight, whoever started more
processes. Where no such controller is ours to write (not root, or cgroup v2, whose single
hierarchy would need the sandboxes' pids groups nested in the tenants'), nothing is
grouped and CPU is shared by process, as before (docs/sharing.md)."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CANDIDATES = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def _pids_root() -> Path | None:
    for base in CANDIDATES:
        p = Path(base)
        v1 = (p / "tasks").exists() and (p / "cgroup.procs").exists() and p.name == "pids"
        v2 = (p / "cgroup.controllers").exists() and "pids" in (
            (p / "cgroup.controllers").read_text().split())
        if (v1 or v2) and os.access(p, os.W_OK):
            return p
    return None


_ROOT = _pids_root()


def create(sandbox_id: str, max_pids: int) -> Path | None:
    """A new pids cgroup capped at ``max_pids``, or None where cgroups are not ours to use."""
    if _ROOT is None:
        return None
    path = _ROOT / f"prorl-{sandbox_id}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(max_pids))
    except OSError as e:
        log.warning("no pids cgroup for sandbox %s: %s", sandbox_id, e)
        return None
    return path


def pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_all_and_remove(path: Path, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while True:
        left = pids(path)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > end:
                log.warning("cgroup %s still busy: %s", path, left)
                return
            time.sleep(0.02)


CPU_CANDIDATES = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")
# The tenants' groups, under the cpu controller's root.
TENANTS_DIR = "prorl-tenants"


def _cpu_root() -> Path | None:
    for base in CPU_CANDIDATES:
        p = Path(base)
        if (p / "cpu.shares").exists() and os.access(p, os.W_OK):
            return p / TENANTS_DIR
    return None


_CPU_ROOT = _cpu_root()
_cpu_groups: dict[str, tuple[Path, int]] = {}  # tenant -> (its group, the shares written)
_cpu_lock = threading.Lock()


def shares_of(weight: float) -> int:
    """``cpu.shares`` for a tenant of ``weight`` (1024 per unit; the kernel's bounds)."""
    return max(2, min(262_144, round(1024 * weight)))


def tenant_cpu(tenant: str, weight: float = 1.0) -> Path | None:
    """The CPU group of ``tenant`` (made, and its shares set, on first use in this process
    or when its weight changed), or None where CPU groups are not ours to use."""
    if _CPU_ROOT is None:
        return None
    shares = shares_of(weight)
    with _cpu_lock:
        known = _cpu_groups.get(tenant)
        if known is not None and known[1] == shares:
            return known[0]
        # A directory name of the tenant's, safe whatever the tenant is called.
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", tenant)[:48]
        path = _CPU_ROOT / f"{safe}-{hashlib.sha1(tenant.encode()).hexdigest()[:8]}"
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / "cpu.shares").write_text(str(shares))
        except OSError as e:
            log.warning("no CPU group for tenant %s: %s", tenant, e)
            return None
        _cpu_groups[tenant] = (path, shares)
        return path


def join(group: Path | str, pid: int) -> bool:
    """Move process ``pid`` (all its threads) into ``group``; False if it could not be."""
    try:
        with open(Path(group) / "cgroup.procs", "w") as f:
            f.write(str(pid))
        return True
    except OSError as e:  # gone, or the group was removed
        log.debug("process %d not moved to %s: %s", pid, group, e)
        return False
