"""A pids cgroup per sandbox, where this process may create one (root, or a delegated
subtree): the only process cap that holds for a farm running as root, since RLIMIT_NPROC
does not apply to uid 0. Also lists and kills everything in the sandbox.

And a CPU group per tenant (cgroup v1's ``cpu`` controller, ``cpu.shares`` = 1024 times the
tenant's weight), which the processes a node starts for a tenant's jobs join (its sandboxes,
graders' among them, and the answer-grading helpers while they grade for it): when the
node's CPUs are contended, each tenant's work gets CPU by its weight, whoever started more
processes. The tenants' groups, and one of the node's pools themselves, are in one group of
the farm's node (named by the farm's Redis and the node: two farms on one host share
nothing), weighted as one busy process per CPU against the host's other processes, and
removed when the node's last pool stops. Where no such controller is ours to write (not
root, or cgroup v2, whose single hierarchy would need the sandboxes' pids groups nested in
the tenants'), nothing is grouped and CPU is shared by process, as before
(docs/sharing.md)."""

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
# Each farm's group on a node, under the cpu controller's root; its tenants' groups in it.
FARM_PREFIX = "prorl-cpu-"


def _cpu_controller() -> Path | None:
    for base in CPU_CANDIDATES:
        p = Path(base)
        if (p / "cpu.shares").exists() and os.access(p, os.W_OK):
            return p
    return None


_CPU_BASE = _cpu_controller()
# (farm, tenant) -> (the tenant's group, the shares written)
_cpu_groups: dict[tuple[str, str], tuple[Path, int]] = {}
_cpu_lock = threading.Lock()


def farm_cpu_id(redis_url: str, node: str) -> str:
    """The name of a farm's node in the CPU hierarchy: the same in every process of the
    node's pools, another for another farm (or node) on the same host."""
    return hashlib.sha1(f"{redis_url}\0{node}".encode()).hexdigest()[:12]


def farm_cpu_group(farm: str) -> Path | None:
    """The CPU group of a farm's node (where its tenants' groups are), or None."""
    return None if _CPU_BASE is None else _CPU_BASE / f"{FARM_PREFIX}{farm}"


def farm_shares() -> int:
    """The weight of a farm's node against the host's other processes: as many busy
    processes as it has CPUs (1024 each), so its jobs together may take every CPU, as
    they could before they were grouped, and no more than that against what else runs."""
    return shares_of(len(os.sched_getaffinity(0)))


def shares_of(weight: float) -> int:
    """``cpu.shares`` for a tenant of ``weight`` (1024 per unit; the kernel's bounds)."""
    return max(2, min(262_144, round(1024 * weight)))


def _make(parent: Path, group: Path, shares: int) -> None:
    """Make ``group`` (with ``shares``) in the farm node's group ``parent``, made first if
    it is not there (with the node's weight). OSError where it cannot be."""
    if not parent.is_dir():
        parent.mkdir(exist_ok=True)
        (parent / "cpu.shares").write_text(str(farm_shares()))
    group.mkdir(exist_ok=True)
    (group / "cpu.shares").write_text(str(shares))


def tenant_cpu(tenant: str, weight: float = 1.0, farm: str = "") -> Path | None:
    """The CPU group of ``tenant`` on ``farm``'s node (made, and its shares set, on first
    use in this process, when its weight changed or when it was removed), or None where CPU
    groups are not ours to use."""
    parent = farm_cpu_group(farm)
    if parent is None:
        return None
    shares = shares_of(weight)
    with _cpu_lock:
        known = _cpu_groups.get((farm, tenant))
        if known is not None and known[1] == shares and known[0].is_dir():
            return known[0]
        # A directory name of the tenant's, safe whatever the tenant is called.
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", tenant)[:48]
        path = parent / f"{safe}-{hashlib.sha1(tenant.encode()).hexdigest()[:8]}"
        try:
            _make(parent, path, shares)
        except OSError as e:
            log.warning("no CPU group for tenant %s: %s", tenant, e)
            return None
        _cpu_groups[(farm, tenant)] = (path, shares)
        return path


# The group of the node's pools themselves, beside its tenants' groups (a name no tenant's
# group has: theirs end in a hash).
POOLS_GROUP = "pools"


def join_farm_cpu(farm: str) -> bool:
    """Move this process (a pool of the farm's node) into the node's own group, beside its
    tenants' groups and weighted as much as all of them: the pools' work for every tenant
    (starting sandboxes, reading answers, the stage scripts) is not left to compete with a
    tenant's graders one process against a group. What the pool starts for a job joins the
    job's tenant's group; what it starts for nobody's job stays here."""
    parent = farm_cpu_group(farm)
    if parent is None:
        return False
    group = parent / POOLS_GROUP
    try:
        with _cpu_lock:
            _make(parent, group, farm_shares())
    except OSError as e:
        log.warning("the pools' CPU group could not be made: %s", e)
        return False
    return join(group, os.getpid())


def release_farm_cpu(farm: str) -> None:
    """Remove the farm node's CPU groups that nothing is in any more (every pool of the
    node calls it as it stops: the last one out removes them all)."""
    parent = farm_cpu_group(farm)
    if parent is None or not parent.is_dir():
        return
    join(_CPU_BASE, os.getpid())  # out of the pools' group, if this process was in it
    with _cpu_lock:
        for key in [k for k in _cpu_groups if k[0] == farm]:
            del _cpu_groups[key]
        for group in parent.iterdir():
            if group.is_dir():
                try:
                    group.rmdir()
                except OSError:  # a process of another pool of the node is in it
                    pass
        try:
            parent.rmdir()
        except OSError:
            pass


def join(group: Path | str, pid: int) -> bool:
    """Move process ``pid`` (all its threads) into ``group``; False if it could not be."""
    try:
        with open(Path(group) / "cgroup.procs", "w") as f:
            f.write(str(pid))
        return True
    except OSError as e:  # gone, or the group was removed
        log.debug("process %d not moved to %s: %s", pid, group, e)
        return False
