"""ToolConnection: what RUN and EVAL workers use to call the tools in a sandbox."""

from __future__ import annotations

import socket
import threading

from prorl_farm.errors import JobAborted, SandboxError, ToolRejected
from prorl_farm.toolserver.protocol import FrameReader, ProtocolError, send_frame


class ToolConnection:
    """One persistent connection to a sandbox's tool server; calls are serialised."""

    def __init__(self, socket_path: str, connect_timeout_s: float = 5.0):
        self.socket_path = socket_path
        self.connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._reader: FrameReader | None = None
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.connect_timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as e:
            sock.close()
            raise SandboxError(f"cannot reach tool server at {self.socket_path}: {e}") from e
        sock.settimeout(None)
        return sock

    def call(self, tool: str, abort_hook=None, **args):
        """Call ``tool``; returns its result, raises ToolRejected, SandboxError, JobAborted."""
        with self._lock:
            if self._sock is None:
                self._sock = self._connect()
                self._reader = FrameReader(self._sock)
            sock, reader = self._sock, self._reader
            aborted = False

            def interrupt() -> None:
                nonlocal aborted
                aborted = True
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            remove = abort_hook(interrupt) if abort_hook else None
            try:
                send_frame(sock, {"tool": tool, "args": args})
                reply = reader.read()
            except (OSError, ProtocolError) as e:
                self.close_locked()
                if aborted:
                    raise JobAborted("tool call aborted") from e
                raise SandboxError(f"tool server connection failed: {e}") from e
            finally:
                if remove:
                    remove()
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise ToolRejected(err.get("message", ""), err.get("type", "error"))
        return reply["result"]

    def close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()

    # Conveniences.
    def bash(self, command: str, timeout_s: float = 120.0, **kw) -> dict:
        return self.call("bash", command=command, timeout_s=timeout_s, **kw)

    def exec(self, argv: list[str], timeout_s: float = 60.0, **kw) -> dict:
        return self.call("exec", argv=argv, timeout_s=timeout_s, **kw)

    def ipython(self, code: str, timeout_s: float = 120.0, **kw) -> dict:
        return self.call("ipython", code=code, timeout_s=timeout_s, **kw)
