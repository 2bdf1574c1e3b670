"""The tool server's wire format: each message is a 4-byte big-endian length, then that many
bytes of UTF-8 JSON. Requests: ``{"tool", "args"}``; replies: ``{"ok": true, "result"}`` or
``{"ok": false, "error": {"type", "message"}}``."""

from __future__ import annotations

import json
import socket
import struct

MAX_FRAME_BYTES = 256 * 1024 * 1024
_HEADER = struct.Struct(">I")


class ProtocolError(ConnectionError):
    pass


def send_frame(sock: socket.socket, obj) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes is over the limit")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ProtocolError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket):
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {n} bytes is over the limit")
    return json.loads(_recv_exact(sock, n))
