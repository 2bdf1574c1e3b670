"""The in-sandbox tool server: ``python -m prorl_farm.sandbox.server --socket PATH
--workspace DIR``. Listens on a Unix domain socket; see protocol.py for the framing.

Tools: ``ping``; ``bash`` (command, timeout_s, no_output_timeout_s); ``ipython`` (code,
timeout_s); ``view`` (path, start_line, end_line), ``create`` (path, content, overwrite),
``str_replace`` (path, old_str, new_str), ``insert`` (path, line, text), ``undo`` (path).
A tool's own error comes back as an error reply; the server keeps serving.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socketserver
import sys
import threading

from prorl_farm.sandbox.protocol import FrameReader, ProtocolError, send_frame
from prorl_farm.sandbox.tools import ToolError
from prorl_farm.sandbox.tools.bash import BashSession
from prorl_farm.sandbox.tools.files import FileEditor
from prorl_farm.sandbox.tools.ipython import IPythonSession

log = logging.getLogger("prorl_farm.sandbox.server")


class Tools:
    def __init__(self, workspace: str, runtime_dir: str):
        self.bash = BashSession(workspace)
        self.bash.start()
        self.ipython = IPythonSession(workspace, runtime_dir)
        self.files = FileEditor(workspace)
        self._locks = {name: threading.Lock() for name in ("bash", "ipython", "files")}

    def call(self, tool: str, args: dict):
        if tool == "ping":
            return {"pong": True, "pid": os.getpid(), "ip": os.environ.get("PRORL_SANDBOX_IP")}
        if tool == "bash":
            with self._locks["bash"]:
                return self.bash.run(**args)
        if tool == "ipython":
            with self._locks["ipython"]:
                return self.ipython.run(**args)
        if tool in ("view", "create", "str_replace", "insert", "undo"):
            with self._locks["files"]:
                return getattr(self.files, tool)(**args)
        raise LookupError(f"unknown tool {tool!r}")

    def close(self) -> None:
        self.ipython.close()
        self.bash.close()


def reply_for(tools: Tools, request) -> dict:
    if not isinstance(request, dict) or not isinstance(request.get("tool"), str):
        return {"ok": False, "error": {"type": "bad_request", "message": "need {tool, args}"}}
    args = request.get("args") or {}
    if not isinstance(args, dict):
        return {"ok": False, "error": {"type": "bad_request", "message": "args: not an object"}}
    try:
        return {"ok": True, "result": tools.call(request["tool"], args)}
    except ToolError as e:
        return {"ok": False, "error": {"type": "tool_error", "message": str(e)}}
    except (LookupError, TypeError) as e:
        return {"ok": False, "error": {"type": "bad_request", "message": str(e)}}
    except Exception as e:  # a tool bug must not take the server down
        log.exception("tool %s failed", request.get("tool"))
        return {"ok": False, "error": {"type": "internal", "message": f"{type(e).__name__}: {e}"}}


def make_server(socket_path: str, tools: Tools) -> socketserver.ThreadingUnixStreamServer:
    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            reader = FrameReader(self.request)
            while True:
                try:
                    request = reader.read()
                except (ProtocolError, OSError, ValueError):
                    return
                try:
                    send_frame(self.request, reply_for(tools, request))
                except OSError:
                    return

    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server = socketserver.ThreadingUnixStreamServer(socket_path, Handler)
    server.daemon_threads = True
    return server


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="prorl-farm in-sandbox tool server")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--runtime-dir", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.chdir(args.workspace)
    tools = Tools(args.workspace, args.runtime_dir or os.path.join(args.workspace, ".prorl"))
    # Ready = the socket exists, so bind it only once the tools are up, under a temp name.
    tmp = args.socket + ".starting"
    server = make_server(tmp, tools)
    os.rename(tmp, args.socket)

    def stop(*_):
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        tools.close()
        server.server_close()
        try:
            os.unlink(args.socket)
        except FileNotFoundError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
