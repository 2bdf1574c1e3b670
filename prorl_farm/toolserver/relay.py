"""The model gateway's door inside a sandbox: a TCP listener on the sandbox's own loopback
address that relays each connection to the gateway's Unix socket, bound in from the host
(``/run/prorl/gw/gateway.sock``). A sandbox has no network, so this is the only way out
it has, and it leads to one place: the gateway, which answers only its job's key. A
connection made while no gateway serves the job is closed at once."""

from __future__ import annotations

import socket
import threading

CHUNK = 64 * 1024


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _relay(conn: socket.socket, path: str) -> None:
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(path)
    except OSError:
        up.close()
        conn.close()
        return
    back = threading.Thread(target=_pump, args=(up, conn), daemon=True)
    back.start()
    _pump(conn, up)
    back.join()
    up.close()
    conn.close()


def serve_relay(host: str, port: int, path: str) -> socket.socket:
    """Listen on ``host:port`` and relay every connection to the Unix socket ``path`` (in a
    daemon thread); returns the listening socket."""
    listener = socket.create_server((host, port), backlog=128)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_relay, args=(conn, path), daemon=True).start()

    threading.Thread(target=accept, name="gateway-relay", daemon=True).start()
    return listener
