"""What the host and the tool server inside a sandbox agree on.

The wire format: each message is a 4-byte big-endian length, then that many bytes of UTF-8
JSON. Requests: ``{"tool", "args"}``; replies: ``{"ok": true, "result"}`` or
``{"ok": false, "error": {"type", "message"}}``. And the places and names both sides use:
where the farm's package, the workspace and the socket are inside, and the environment
the farm gives every program in a sandbox."""

from __future__ import annotations

import json
import socket
import struct

from prorl_farm.errors import ProtocolError

MAX_FRAME_BYTES = 256 * 1024 * 1024
# Where the farm's own package is bound inside a sandbox (read-only): only the package, not
# the checkout or install tree around it.
INSIDE_FARM = "/opt/prorl"
# Where isolating runtimes put the workspace and the tool server's socket, inside.
INSIDE_WORKSPACE = "/workspace"
INSIDE_RUN = "/run/prorl"
# The model gateway, inside a sandbox that has one: its Unix socket (in a directory bound in
# from the host) and the loopback port the tool server relays to it (toolserver/relay.py).
INSIDE_GATEWAY_DIR = f"{INSIDE_RUN}/gw"
GATEWAY_SOCKET = "gateway.sock"
GATEWAY_PORT = 8009
# Where a sandbox with the gateway finds the operator's agent harness environments.
INSIDE_HARNESSES = "/opt/harnesses"
# Set for every program in a sandbox: its id (how the host finds its processes), and its
# own loopback IP for services it starts.
SANDBOX_ENV = "PRORL_SANDBOX_ID"
IP_ENV = "PRORL_SANDBOX_IP"
_HEADER = struct.Struct(">I")


__all__ = ["FrameReader", "ProtocolError", "send_frame"]


def send_frame(sock: socket.socket, obj) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes is over the limit")
    sock.sendall(_HEADER.pack(len(data)) + data)


class FrameReader:
    """Reads frames from one connection with a buffer: a small message costs one recv."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, min(n - len(self.buf), 1 << 20)))
            if not chunk:
                raise ProtocolError("connection closed")
            self.buf += chunk

    def read(self):
        self._fill(_HEADER.size)
        (n,) = _HEADER.unpack_from(self.buf)
        if n > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {n} bytes is over the limit")
        self._fill(_HEADER.size + n)
        data = bytes(self.buf[_HEADER.size:_HEADER.size + n])
        del self.buf[:_HEADER.size + n]
        return json.loads(data)
