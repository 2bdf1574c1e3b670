"""``exec``: run a program (an argv, no shell) in a clean environment and return its exit
status, stdout and stderr apart. For graders: nothing of the agent's shell (functions,
aliases, variables, PATH, traps) applies, Python finds no user site, no PYTHON* variables
and no script-directory imports, and everything the program started is killed after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading

from prorl_farm.errors import ToolRejected

MAX_STREAM = 1024 * 1024
CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp",
    "TMPDIR": "/tmp", "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1",
    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
}
# Programs started with a ``name`` (e.g. an agent harness), which ``kill`` may end early.
_NAMED: dict[str, int] = {}
_NAMED_LOCK = threading.Lock()


def _cap(data: bytes) -> tuple[str, bool]:
    if len(data) <= MAX_STREAM:
        return data.decode("utf-8", errors="replace"), False
    half = MAX_STREAM // 2
    text = (data[:half] + f"\n[... {len(data) - MAX_STREAM} bytes omitted ...]\n".encode()
            + data[-half:])
    return text.decode("utf-8", errors="replace"), True


def execute(cwd: str, argv: list[str], timeout_s: float = 60.0, stdin: str | None = None,
            env: dict[str, str] | None = None, name: str | None = None) -> dict:
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ToolRejected("argv must be a non-empty list of strings")
    extra = {k: v for k, v in (env or {}).items() if isinstance(k, str) and isinstance(v, str)}
    try:
        proc = subprocess.Popen(
            argv, cwd=cwd, env={**CLEAN_ENV, **extra}, close_fds=True,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        raise ToolRejected(f"cannot run {argv[0]!r}: {e.strerror}") from None
    if name is not None:
        with _NAMED_LOCK:
            _NAMED[str(name)] = proc.pid
    timed_out = False
    try:
        out, err = proc.communicate(stdin.encode() if stdin is not None else None,
                                    timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(proc.pid)
        out, err = proc.communicate()
    finally:
        _kill(proc.pid)  # whatever it left running in its session
        if name is not None:
            with _NAMED_LOCK:
                if _NAMED.get(str(name)) == proc.pid:
                    del _NAMED[str(name)]
    stdout, cut_out = _cap(out)
    stderr, cut_err = _cap(err)
    code = proc.returncode
    return {"exit_code": code if code >= 0 else 128 - code, "signal": -code if code < 0 else 0,
            "stdout": stdout, "stderr": stderr, "timed_out": timed_out,
            "truncated": cut_out or cut_err}


def kill_named(name: str) -> dict:
    """End the program ``exec`` started under ``name`` (and its session) now; its ``exec``
    call then returns with the signal. Nothing running under that name: killed false."""
    with _NAMED_LOCK:
        pgid = _NAMED.get(str(name))
    if pgid is not None:
        _kill(pgid)
    return {"killed": pgid is not None}


def _kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
