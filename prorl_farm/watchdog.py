"""A pool's watchdog: a small process of its own that ends the pool if the pool's liveness
thread stops ticking while its process lives.

A pool process can be wedged without dying: a C extension that never returns while holding
the interpreter stops every thread, the liveness thread included, so the heartbeats stop,
but the process, and with it its Redis connection, stays, and nothing recovers its jobs
until the heartbeats are stale, and nothing restarts it at all. The watchdog, started by
the pool before anything else (``python -m prorl_farm.watchdog``), reads one byte
per liveness tick from a pipe. Once armed by the first tick, if no tick comes for
``PRORL_WATCHDOG_S`` seconds it kills the pool with SIGKILL and exits: what supervises the
pool (``prorl-farm up``, the Slurm worker script, compose's restart policy) starts a new
one, and the reaper recovers the dead pool's jobs as for any dead pool (its Redis
connection closes with it). It exits by itself when the pool exits (the pipe closes) and
dies with it (parent-death signal).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from prorl_farm.sandbox.process import parent_death_signal


class Watchdog:
    """The pool's side: start the watchdog, then :meth:`tick` from the liveness loop."""

    def __init__(self, stale_s: float, name: str):
        self.fd = None
        if stale_s <= 0:
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prorl_farm.watchdog", str(os.getpid()),
             str(stale_s), str(r), name], pass_fds=(r,), stdin=subprocess.DEVNULL,
            close_fds=True, preexec_fn=_die_with_parent)
        os.close(r)
        self.fd = w

    def tick(self) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, b".")
        except (BlockingIOError, BrokenPipeError):
            pass


def _die_with_parent() -> None:
    try:
        parent_death_signal(signal.SIGKILL)
    except OSError:
        pass


def watch(pool_pid: int, stale_s: float, fd: int, name: str) -> int:
    armed_at = None
    while True:
        timeout = None if armed_at is None else max(0.0, armed_at + stale_s - time.monotonic())
        ready, _, _ = select.select([fd], [], [], timeout)
        if ready:
            if not os.read(fd, 4096):
                return 0  # the pool exited
            armed_at = time.monotonic()
            continue
        print(f"prorl-farm watchdog: the {name} pool (pid {pool_pid}) has not ticked for "
              f"{stale_s:g} s while alive (wedged); killing it", file=sys.stderr, flush=True)
        try:
            os.kill(pool_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return 0


if __name__ == "__main__":
    raise SystemExit(watch(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]),
                           sys.argv[4]))
