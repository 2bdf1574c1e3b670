"""Ending a helper process: SIGKILL to the process group it leads, the process reaped, its
pipes closed. The standard library alone: the code grader's harness includes this text
(``# include: ending.py``) and the answer helpers import it."""

import os
import signal


def end_process(proc) -> None:
    """SIGKILL the group ``proc`` leads, wait for ``proc``, close its stdin and stdout."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
