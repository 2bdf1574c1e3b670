"""The workspace as a whole, held to a size: the in-sandbox half of ``Limits.workspace_bytes``.
The sandbox's ``/tmp`` and ``/var/tmp`` (directories on the node's disk beside it) count
with it.

The workspace is a directory on the node's disk (the repository of a ``swe`` task lives
there), so no tmpfs bound applies, and a quota needs privileges a farm may not have. The
tool server measures it instead (``st_blocks`` of every file under it, hard links counted
once, symbolic links not followed, other file systems not entered), as often as costs at
most ``COST_SHARE`` of one core and at least every ``MAX_EVERY_S`` (a tree of 11,000
entries, a SWE-bench repository with its build, takes about 0.2 s: every 4 s), and after a
tool call if that much time has passed. Past the limit it kills
every process of the sandbox but itself (it is the sandbox's pid 1; elsewhere, the process
groups of what its tools started) whenever the use has grown, so that a write goes on for
one interval at most; the tool call that was running returns with ``workspace_full``, and
so does every call while the workspace stays over (its tools still work: a command may
remove files). Per file, ``RLIMIT_FSIZE`` bounds
what one write can add in the meantime.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from prorl_farm.toolserver.disk import disk_usage

COST_SHARE = 0.05  # of one core, for the measuring
MIN_EVERY_S = 0.2
MAX_EVERY_S = 10.0


class WorkspaceGuard:
    def __init__(self, root: str, limit_bytes: int, groups=lambda: set(),
                 also: tuple[str, ...] = ()):
        self.root, self.limit = root, limit_bytes
        # Measured with the workspace, against the same limit: the sandbox's /tmp and
        # /var/tmp, directories on the node's disk beside the workspace (not memory).
        self.also = tuple(also)
        self.groups = groups  # process groups its tools started (where it is not pid 1)
        self.used = 0
        self.kills = 0
        self.every = MIN_EVERY_S
        self.checked_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="workspace")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def over(self) -> bool:
        return self.used > self.limit

    def report(self) -> dict:
        return {"limit_mb": self.limit >> 20, "used_mb": round(self.used / 2**20, 1)}

    def check(self) -> bool:
        """Measure now; past the limit and grown since the last look, kill what writes (a
        workspace that stays over without growing is left to the agent to clean up: its
        tools keep working). Whether it is past."""
        before, started = self.used, time.monotonic()
        self.used = sum(disk_usage(root) for root in (self.root, *self.also))
        self.checked_at = time.monotonic()
        cost = self.checked_at - started
        self.every = min(MAX_EVERY_S, max(MIN_EVERY_S, cost / COST_SHARE))
        if self.over and self.used > before:
            self.kills += 1
            self._kill()
        return self.over

    def due(self) -> bool:
        return time.monotonic() - self.checked_at >= self.every

    def _kill(self) -> None:
        if os.getpid() == 1:  # every process of the sandbox but this one
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            return
        for pgid in self.groups():
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass

    def _loop(self) -> None:
        while not self._stop.wait(max(0.05, self.every - (time.monotonic() -
                                                           self.checked_at))):
            if self.due():
                self.check()
