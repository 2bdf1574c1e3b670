"""Warm graders: grading sandboxes an EVAL pool process keeps, each serving problem after
problem (``code_harness.py --serve``), so that a ``code`` grading pays neither a sandbox's
start and stop nor the harness's own start.

What a grading shares with the one before it on the same grader: the grader's sandbox and
the harness process it forks from, which has run nothing of any task. What it does not: the
program runs in a fresh jail (its own namespaces, user, ``/tmp``), the task's test code in a
fork of the harness that ends with the grading, and the grader's scratch (``/tmp``) is
emptied between problems. A grader serves one tenant (and its CPU group): the test code of
one tenant's tasks never runs in a sandbox another's will use. One problem at a time per
grader; a pool process keeps as many as it grades at once.

Nothing is left behind: a grader idle for ``PRORL_GRADER_IDLE_S`` is stopped, so is every
grader when its pool stops; a grading cancelled or past its time stops its grader (it is
not handed on); a grader's sandbox dies with its pool's process (bubblewrap's
``--die-with-parent``, the container's lifeline), and its record (``keys.graders``) holds a
lease the pool renews, so the node's janitor stops what a killed pool left.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct
import threading
import time
import uuid
from pathlib import Path

from prorl_farm import keys
from prorl_farm.errors import FarmError, JobAborted
from prorl_farm.sandbox.abstract import Limits, SandboxSpec
from prorl_farm.sandbox.connection import ToolConnection
from prorl_farm.sandbox.manager import GRADER_PREFIX as PREFIX

log = logging.getLogger(__name__)

SOCKET = "grader.sock"  # in the grader's workspace
LEASE_S = 60.0  # a grader's record expires this long after its pool last renewed it
READY_S = 60.0  # how long a new grader may take to serve
UNIX_PATH_MAX = 107


class Unavailable(FarmError):
    """No warm grader could serve this grading (the caller grades in a fresh sandbox)."""


class Grader:
    def __init__(self, manager, key: str, files: dict, limits: Limits, ctx):
        self.manager, self.key = manager, key
        self.handle = PREFIX + uuid.uuid4().hex[:16]
        self.last_used = time.monotonic()
        self._lease()
        try:
            self.sandbox = manager.start(SandboxSpec(workspace_files=files, limits=limits),
                                         self.handle, 0, ctx)
        except BaseException:
            manager.r.hdel(keys.graders(manager.node), self.handle)
            raise
        self.path = str(Path(self.sandbox.workspace) / SOCKET)
        self.client = ToolConnection(self.sandbox.socket)
        self.exited: dict | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"grader-{self.sandbox.id}")
        self._thread.start()

    def _lease(self) -> None:
        self.manager.r.hset(keys.graders(self.manager.node), self.handle,
                            json.dumps({"until": time.time() + LEASE_S, "pid": os.getpid()}))

    def _serve(self) -> None:
        try:
            self.exited = self.client.call(
                "exec", argv=["python3", "-I", "-S", "code_harness.py", "--serve", SOCKET],
                timeout_s=7 * 86400, env={})
        except Exception as e:  # noqa: BLE001 - stopped, or its sandbox died: it is gone
            self.exited = {"error": str(e)}

    def wait_ready(self) -> None:
        """Until the harness serves (its socket is there), or it exited."""
        end = time.monotonic() + READY_S
        pause = 0.002
        while not os.path.exists(self.path):
            if self.exited is not None or time.monotonic() > end:
                raise Unavailable(f"the warm grader did not serve: {self.exited}")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def grade(self, spec: dict, program: str, timeout_s: float, ctx) -> dict:
        """The harness's output for one problem, as an ``exec`` result."""
        data = json.dumps({**spec, "program": program}).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        aborted = threading.Event()

        def interrupt() -> None:
            aborted.set()
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        remove = ctx.on_abort(interrupt) if ctx is not None else None
        try:
            try:
                conn.connect(self.path)
            except OSError as e:
                raise Unavailable(f"the warm grader is gone: {e}") from None
            conn.sendall(struct.pack("<Q", len(data)) + data)
            chunks, end, timed_out = [], time.monotonic() + timeout_s, False
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                if not select.select([conn], [], [], left)[0]:
                    continue
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:
            if aborted.is_set():
                raise JobAborted("grading aborted") from None
            chunks, timed_out = [], False
        finally:
            if remove:
                remove()
            conn.close()
        if aborted.is_set():
            raise JobAborted("grading aborted")
        self.last_used = time.monotonic()
        return {"stdout": b"".join(chunks).decode(errors="replace"), "timed_out": timed_out,
                "exit_code": 0 if chunks else -1,
                "stderr": "" if chunks else f"the warm grader ended: {self.exited}"}

    @property
    def alive(self) -> bool:
        return self.exited is None

    def stop(self) -> None:
        # The sandbox first: its end ends the serving exec, which holds the connection.
        try:
            self.manager.stop(self.sandbox)
        finally:
            self._thread.join(5)
            self.client.close()
            self.manager.take_started(self.handle)
            self.manager.r.hdel(keys.graders(self.manager.node), self.handle)


class WarmGraders:
    """A pool process's warm graders, by key (tenant and its CPU group, runtime, files'
    version)."""

    def __init__(self, idle_s: float = 5.0):
        self.idle_s = idle_s
        self._idle: dict[str, list[Grader]] = {}
        self._busy: set[Grader] = set()
        self._lock = threading.Lock()
        self._keeper: threading.Thread | None = None
        self._stop = threading.Event()
        self._failed: dict[str, str] = {}  # runtime -> why its graders did not serve

    def grade(self, ctx, files: dict, spec: dict, program: str, timeout_s: float,
              limits: Limits) -> dict:
        """The harness's output (an ``exec`` result) for ``program``, from a warm grader of
        the job's tenant; :class:`Unavailable` if none could grade it (nothing was graded)."""
        manager = ctx.sandboxes
        if len(str(Path(manager.root) / ("x" * 12) / "workspace" / SOCKET)) + 4 > UNIX_PATH_MAX:
            raise Unavailable("the sandbox root's path is too long for a socket")
        runtime = manager.runtime.name
        if runtime in self._failed:  # tried once: this process grades there afresh
            raise Unavailable(self._failed[runtime])
        key = json.dumps([ctx.tenant, ctx.cpu_group, runtime, sorted(
            (name, hash(text)) for name, text in files.items())])
        grader = self._take(key)
        if grader is None:
            grader = Grader(manager, key, files, limits, ctx)
            with self._lock:
                self._busy.add(grader)
                if self._keeper is None:
                    self._keeper = threading.Thread(target=self._keep, daemon=True,
                                                    name="warm-graders")
                    self._keeper.start()
            try:
                grader.wait_ready()
            except Unavailable as e:
                self._failed[runtime] = str(e)
                self._drop(grader)
                raise
            except BaseException:
                self._drop(grader)
                raise
        handed_back = False
        try:
            out = grader.grade(spec, program, timeout_s, ctx)
            if out["exit_code"] == 0 and not out["timed_out"] and grader.alive:
                self._give_back(grader)
                handed_back = True
            return out
        finally:
            if not handed_back:
                self._drop(grader)

    def _take(self, key: str) -> Grader | None:
        with self._lock:
            idle = self._idle.get(key) or []
            while idle:
                grader = idle.pop()
                if grader.alive:
                    self._busy.add(grader)
                    return grader
                threading.Thread(target=grader.stop, daemon=True).start()
            return None

    def _give_back(self, grader: Grader) -> None:
        with self._lock:
            if not self._stop.is_set():
                self._busy.discard(grader)
                self._idle.setdefault(grader.key, []).append(grader)
                return
        self._drop(grader)  # its pool is stopping

    def _drop(self, grader: Grader) -> None:
        with self._lock:
            self._busy.discard(grader)
        try:
            grader.stop()
        except Exception:  # noqa: BLE001 - the janitor stops what is left
            log.warning("could not stop warm grader %s", grader.handle, exc_info=True)

    def _keep(self) -> None:
        """Stops graders idle past ``idle_s``; renews the leases of the others."""
        renewed = time.monotonic()
        while not self._stop.wait(min(1.0, self.idle_s / 4)):
            now = time.monotonic()
            expired = []
            with self._lock:
                for idle in self._idle.values():
                    for grader in list(idle):
                        if now - grader.last_used > self.idle_s or not grader.alive:
                            idle.remove(grader)
                            expired.append(grader)
                live = [g for idle in self._idle.values() for g in idle] + list(self._busy)
            for grader in expired:
                self._drop(grader)
            if now - renewed > LEASE_S / 4:
                renewed = now
                for grader in live:
                    try:
                        grader._lease()
                    except Exception:  # noqa: BLE001 - Redis away: renewed next time
                        pass

    def count(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._idle.values()) + len(self._busy)

    def close(self) -> None:
        """Stop every idle grader (a busy one is stopped as its grading ends); none is kept
        from now on."""
        with self._lock:
            self._stop.set()
            graders = [g for idle in self._idle.values() for g in idle]
            self._idle.clear()
        for grader in graders:
            self._drop(grader)


_GRADERS: WarmGraders | None = None
_GRADERS_LOCK = threading.Lock()


def graders(idle_s: float) -> WarmGraders:
    global _GRADERS
    with _GRADERS_LOCK:
        if _GRADERS is None:
            _GRADERS = WarmGraders(idle_s)
        _GRADERS.idle_s = idle_s
        return _GRADERS


def close_graders() -> None:
    """At a pool's end: its warm graders go with it."""
    with _GRADERS_LOCK:
        graders_ = _GRADERS
    if graders_ is not None:
        graders_.close()
