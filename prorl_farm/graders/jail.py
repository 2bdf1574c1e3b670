# The jail: a nested sandbox for the program under test, inside a grader's sandbox.
# Included into a grader script where it says "# include: jail.py" (graders run isolated,
# with nothing importable beside them).

import json
import os
import shutil
import subprocess
import tempfile
import time

JAIL_UID = 1001  # inside the jail's own user namespace: not the grader's uid there


class JailError(RuntimeError):
    """The jail could not run the program (the environment's fault, not the candidate's):
    the grader reports an error, never a zero reward."""


class Jail:
    """``popen(argv, binds, cwd)`` runs ``argv`` in a nested bubblewrap sandbox: its own
    user, pid, mount, network, IPC and UTS namespaces, no capabilities, the grader's root
    read-only, fresh ``/proc``, ``/dev``, ``/tmp`` and ``/run``, an empty ``/workspace``
    holding only ``binds`` (``(path, writable)``, at the same path), dying with its parent.
    Its ``/tmp`` is a new directory on disk, in the grader's own ``/tmp`` (the grader's
    sandbox counts it in its workspace's size), removed when the program is checked; its
    ``/dev/shm`` (memory) holds at most ``shm_mb``, its ``/run`` and ``/workspace`` 1 MiB.
    From inside, the grader's processes cannot be seen or signalled, and nothing of the
    grader's sandbox but the read-only system and the binds can be read. Where the jail
    cannot be made (no bubblewrap, or no user namespaces here), the program runs as a plain
    child and ``name`` is ``"none"``.

    After the program ends, ``check(proc)`` raises :class:`JailError` if bubblewrap never
    ran it to its end (bubblewrap reports the program's exit on a status pipe, which the
    program does not hold); call ``check(proc, killed=True)`` when the grader killed it."""

    def __init__(self, shm_mb=64, enabled=True):
        self.shm_bytes = str(shm_mb << 20)  # the jail's /dev/shm is memory: bounded
        self.bwrap = shutil.which("bwrap")
        self.works = False
        # enabled=False (the spec's "jail": false): no jail, the tests of the fallback.
        if enabled and self.bwrap and os.getuid() != 0:
            probe = subprocess.run(self.argv([], "/", None, "/tmp") + ["/bin/true"],
                                   capture_output=True, stdin=subprocess.DEVNULL, timeout=30)
            self.works = probe.returncode == 0
        self._status = {}
        self._scratch = {}  # pid -> the program's /tmp on disk

    @property
    def name(self):
        return "bwrap" if self.works else "none"

    def argv(self, binds, cwd, status_fd, scratch):
        argv = [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net",
                "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--uid",
                str(JAIL_UID), "--gid", str(JAIL_UID), "--cap-drop", "ALL",
                "--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--proc", "/proc",
                "--dev", "/dev", "--size", self.shm_bytes, "--tmpfs", "/dev/shm",
                "--bind", scratch, "/tmp",
                "--size", "1048576", "--tmpfs", "/run", "--size", "1048576", "--tmpfs",
                "/workspace"]
        if status_fd is not None:
            argv += ["--json-status-fd", str(status_fd)]
        for path, writable in binds:
            argv += ["--bind" if writable else "--ro-bind", path, path]
        return argv + ["--chdir", cwd, "--"]

    def popen(self, argv, binds=(), cwd="/workspace", pass_fds=(), **kwargs):
        if not self.works:
            return self._start(argv, pass_fds=pass_fds, cwd=cwd, **kwargs)
        scratch = tempfile.mkdtemp(prefix="jail-")
        r, w = os.pipe()
        try:
            proc = self._start(self.argv(binds, cwd, w, scratch) + argv,
                               pass_fds=(*pass_fds, w), **kwargs)
        except BaseException:
            os.close(r)
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        finally:
            os.close(w)
        self._status[proc.pid] = r
        self._scratch[proc.pid] = scratch
        return proc

    @staticmethod
    def _start(argv, **kwargs):
        try:
            return subprocess.Popen(argv, **kwargs)
        except BlockingIOError as e:  # fork's EAGAIN: the process cap is full for now
            raise JailError(f"could not start the program ({e})") from None

    def run(self, argv, binds=(), cwd="/workspace", **kwargs):
        """Like ``subprocess.run`` with ``capture_output``, text; checked."""
        proc = self.popen(argv, binds, cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, **kwargs)
        out, err = proc.communicate()
        self.check(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def retrying(self, attempt, tries=6):
        """``attempt()``, again after a pause (doubling from 0.25 s: 7.75 s in all) if the
        jail could not run the program: that is transient where the process cap still
        counts the processes of a jail that just ended (the kernel releases them a little
        after they are reaped, later still on a loaded machine)."""
        for i in range(tries):
            try:
                return attempt()
            except JailError:
                if i == tries - 1:
                    raise
                time.sleep(0.25 * 2 ** i)

    def check(self, proc, killed=False):
        scratch = self._scratch.pop(proc.pid, None)
        if scratch is not None:  # the program has ended: its /tmp goes
            shutil.rmtree(scratch, ignore_errors=True)
        fd = self._status.pop(proc.pid, None)
        if fd is None:
            return
        with os.fdopen(fd, "rb") as f:
            records = f.read().decode(errors="replace")
        ended = any("exit-code" in json.loads(line) for line in records.splitlines()
                    if line.strip().startswith("{"))
        if not ended and not killed:
            raise JailError(f"the jail did not run the program to its end (bwrap exit "
                            f"status {proc.returncode})")
