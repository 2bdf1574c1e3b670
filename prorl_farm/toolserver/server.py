"""The in-sandbox tool server: ``python -m prorl_farm.toolserver.server --socket PATH
--workspace DIR``. Listens on a Unix domain socket; see protocol.py for the framing.

Tools: ``ping``; ``bash`` (command, timeout_s, no_output_timeout_s); ``exec`` (argv,
timeout_s, stdin, env, name: a program in a clean environment, for graders and harnesses);
``kill`` (name: ends a named ``exec`` early); ``ipython`` (code,
timeout_s); ``view`` (path, start_line, end_line), ``create`` (path, content, overwrite),
``str_replace`` (path, old_str, new_str), ``insert`` (path, line, text), ``undo`` (path).
A tool's own error comes back as an error reply; the server keeps serving.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import socketserver
import sys
import threading

from prorl_farm.errors import ToolRejected
from prorl_farm.toolserver.bash import BashSession
from prorl_farm.toolserver.execute import execute, kill_named
from prorl_farm.toolserver.files import FileEditor
from prorl_farm.toolserver.ipython import IPythonSession
from prorl_farm.toolserver.protocol import (
    INSIDE_FARM,
    IP_ENV,
    FrameReader,
    ProtocolError,
    send_frame,
)
from prorl_farm.toolserver.quota import WorkspaceGuard

log = logging.getLogger("prorl_farm.toolserver.server")


class Tools:
    def __init__(self, workspace: str, runtime_dir: str, workspace_mb: int | None = None,
                 measured: tuple[str, ...] = ()):
        self.workspace = workspace
        self.bash = BashSession(workspace)
        self.bash.start()
        # The kernel is the agent's: it gets the packages the server itself sees.
        sites = os.pathsep.join(p for p in sys.path
                                if p and ("site-packages" in p or p.startswith(INSIDE_FARM)))
        self.ipython = IPythonSession(workspace, runtime_dir, env={"PYTHONPATH": sites})
        self.files = FileEditor(workspace)
        self._locks = {name: threading.Lock() for name in ("bash", "ipython", "files")}
        self.guard = None
        if workspace_mb:
            self.guard = WorkspaceGuard(workspace, workspace_mb << 20, groups=self.children,
                                        also=measured)
            self.guard.start()

    def call(self, tool: str, args: dict):
        """A tool's result; with ``workspace_full`` (the limit and the use, in MiB) where the
        workspace was past its limit during the call or is after it (what wrote was
        killed)."""
        if self.guard is None or tool == "ping":
            return self._call(tool, args)
        kills = self.guard.kills
        result = self._call(tool, args)
        if self.guard.due() or self.guard.over:  # over: to see it cleaned up at once
            self.guard.check()
        if isinstance(result, dict) and (self.guard.kills > kills or self.guard.over):
            result = {**result, "workspace_full": self.guard.report()}
        return result

    def _call(self, tool: str, args: dict):
        if tool == "ping":
            return {"pong": True, "pid": os.getpid(), "ip": os.environ.get(IP_ENV)}
        if tool == "bash":
            with self._locks["bash"]:
                return self.bash.run(**args)
        if tool == "ipython":
            with self._locks["ipython"]:
                return self.ipython.run(**args)
        if tool == "exec":
            return execute(self.workspace, **args)
        if tool == "kill":
            return kill_named(**args)
        if tool in ("view", "create", "str_replace", "insert", "undo"):
            with self._locks["files"]:
                return getattr(self.files, tool)(**args)
        raise LookupError(f"unknown tool {tool!r}")

    def children(self) -> set[int]:
        """Pids of the children the tools themselves wait for (not to be reaped here)."""
        pids = set()
        if self.bash.proc is not None:
            pids.add(self.bash.proc.pid)
        pids.update(self.ipython.pids())
        return pids

    def close(self) -> None:
        if self.guard is not None:
            self.guard.stop()
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
    except ToolRejected as e:
        return {"ok": False, "error": {"type": e.kind, "message": e.message}}
    except (LookupError, TypeError) as e:
        return {"ok": False, "error": {"type": "bad_request", "message": str(e)}}
    except Exception as e:  # a tool bug must not take the server down
        log.exception("tool %s failed", request.get("tool"))
        return {"ok": False, "error": {"type": "internal", "message": f"{type(e).__name__}: {e}"}}


def make_server(socket_path: str | None, tools: Tools, socket_fd: int | None = None
                ) -> socketserver.ThreadingUnixStreamServer:
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

    if socket_fd is not None:
        # A listening socket the host made: adopt it, and let no child inherit it.
        server = socketserver.ThreadingUnixStreamServer(None, Handler, bind_and_activate=False)
        server.socket.close()
        server.socket = socket.socket(fileno=socket_fd)
        os.set_inheritable(socket_fd, False)
        server.server_address = server.socket.getsockname()
    else:
        if os.path.exists(socket_path):
            os.unlink(socket_path)
        server = socketserver.ThreadingUnixStreamServer(socket_path, Handler)
    server.daemon_threads = True
    return server


PR_SET_DUMPABLE = 4


def _harden() -> None:
    """Out of the agent's reach: not dumpable (no ptrace, no /proc/<pid>/mem, fd or environ
    by processes of the same uid), and no handler for a catchable signal, so as the pid
    namespace's init (bwrap) the kernel drops every signal sent from inside."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("could not make the tool server non-dumpable")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)


def _reap_orphans(stop: threading.Event, managed) -> None:
    """As pid 1, collect the zombies of processes re-parented to us (an agent's background
    jobs whose shell died), leaving the children the tools wait for themselves."""
    me = os.getpid()
    seen: set[int] = set()  # zombies of the last scan: a child someone waits for is gone by now
    while not stop.wait(1.0):
        keep = managed()
        zombies = set()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            if pid in keep:
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] == "Z" and int(fields[1]) == me:
                zombies.add(pid)
                if pid in seen:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
        seen = zombies


def _hold_lifeline(path: str, server) -> None:
    """Serve only while the host's end of ``path`` (a FIFO) is open: a container outlives
    its client (``docker run``, which dies with the worker that started it), so the
    sandbox ends itself at the FIFO's EOF rather than run on until a janitor finds it. The
    FIFO is unlinked once open, so nothing started inside can hold it open too."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # no wait: an EOF at once if none
    os.unlink(path)
    os.set_blocking(fd, True)

    def watch() -> None:
        while os.read(fd, 64):
            pass
        log.warning("the host's end of the lifeline closed: stopping")
        server.shutdown()

    threading.Thread(target=watch, daemon=True, name="lifeline").start()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="prorl-farm in-sandbox tool server")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="bind a listening socket at this path")
    where.add_argument("--socket-fd", type=int, help="serve this listening socket (from the "
                       "host)")
    ap.add_argument("--ready-fd", type=int, help="write 'ready' here once serving")
    ap.add_argument("--ready-path", help="or into this FIFO (containers inherit no fd)")
    ap.add_argument("--lifeline", metavar="FIFO",
                    help="serve while this FIFO has a writer on the host (a container's "
                    "client), stop at its EOF; it is unlinked once opened")
    ap.add_argument("--gateway", metavar="PORT:SOCKET",
                    help="relay this loopback port (on the sandbox's address) to the model "
                    "gateway's Unix socket")
    ap.add_argument("--workspace", required=True)
    ap.add_argument("--runtime-dir", default=None)
    ap.add_argument("--workspace-mb", type=int, default=None,
                    help="hold the workspace as a whole to this many MiB (toolserver/quota.py)")
    ap.add_argument("--measure-also", action="append", default=[], metavar="DIR",
                    help="a directory whose files count against the workspace's limit "
                    "(the sandbox's /tmp on disk)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="cap the tasks of this sandbox's user namespace (RLIMIT_NPROC)")
    return ap


def _say_ready(args) -> None:
    """'ready' on the host's pipe, or into the FIFO (a container inherits no fd)."""
    if args.ready_fd is not None:
        os.write(args.ready_fd, b"ready")
        os.close(args.ready_fd)
    elif args.ready_path:
        fd = os.open(args.ready_path, os.O_WRONLY)
        os.write(fd, b"ready")
        os.close(fd)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    _harden()
    if args.nproc is not None:
        # In its own user namespace the kernel counts this namespace's tasks only: the cap
        # is this sandbox's, whatever else the host user runs. Set before any thread.
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        cap = args.nproc if hard == resource.RLIM_INFINITY else min(args.nproc, hard)
        resource.setrlimit(resource.RLIMIT_NPROC, (cap, cap))
    os.chdir(args.workspace)
    if args.gateway:
        from prorl_farm.toolserver.relay import serve_relay

        port, _, path = args.gateway.partition(":")
        serve_relay(os.environ.get(IP_ENV) or "127.0.0.1", int(port), path)
    tools = Tools(args.workspace, args.runtime_dir or os.path.join(args.workspace, ".prorl"),
                  args.workspace_mb, tuple(args.measure_also))
    if args.socket_fd is not None:
        server = make_server(None, tools, socket_fd=args.socket_fd)
    else:
        # Ready = the socket exists, so bind it only once the tools are up, under a temp name.
        tmp = args.socket + ".starting"
        server = make_server(tmp, tools)
        os.rename(tmp, args.socket)
    if args.lifeline:
        _hold_lifeline(args.lifeline, server)
    stop = threading.Event()
    if os.getpid() == 1:
        threading.Thread(target=_reap_orphans, args=(stop, tools.children), daemon=True,
                         name="reaper").start()
    _say_ready(args)
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        stop.set()
        tools.close()
        server.server_close()
        if args.socket:
            try:
                os.unlink(args.socket)
            except FileNotFoundError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
