"""A pids cgroup per sandbox, where this process may create one (root, or a delegated
subtree): the only process cap that holds for a farm running as root, since RLIMIT_NPROC
does not apply to uid 0. Also lists and kills everything in the sandbox."""

from __future__ import annotations

import logging
import os
import signal
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
