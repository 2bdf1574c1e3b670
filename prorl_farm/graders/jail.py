# The jail: a nested sandbox for the program under test, inside a grader's sandbox.
# Included into a grader script where it says "# include: jail.py" (graders run isolated,
# with nothing importable beside them).

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# include: confine.py
# include-text: confine.py CONFINE_SOURCE

JAIL_UID = 1001  # inside the jail's own user namespace: not the grader's uid there
# The jail's writable places besides its binds: made noexec by its first stage.
SCRATCH = ("/tmp", "/dev/shm", "/run", "/workspace")


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
    With ``disk_mb``, a program that has written more than that to its ``/tmp`` and its
    writable binds together is killed (``filled(proc)`` says so): below the grader's
    sandbox's own bound, which would kill the grader too.
    From inside, the grader's processes cannot be seen or signalled, and nothing of the
    grader's sandbox but the read-only system and the binds can be read. Where the jail
    cannot be made (no bubblewrap, or no user namespaces here), the program runs as a plain
    child and ``name`` is ``"none"``.

    The kernel's part (confine.py): in the jail, a first stage runs as the jail's root
    (bubblewrap keeps CAP_SYS_ADMIN and CAP_SETFCAP for it alone), makes the jail's
    scratch places noexec (and the writable binds, with ``noexec_binds``), moves into a user
    namespace of its own as JAIL_UID, applies Landlock and seccomp, says so on a pipe of
    its own (closed when it executes the program) and executes the program with no
    capability. Without the jail, the program's process applies Landlock and seccomp before
    its exec (no noexec, no user of its own). A program whose confinement failed never
    runs: ``check`` raises :class:`JailError`.

    After the program ends, ``check(proc)`` raises :class:`JailError` if bubblewrap never
    ran it to its end (bubblewrap reports the program's exit on a status pipe, which the
    program does not hold); call ``check(proc, killed=True)`` when the grader killed it."""

    def __init__(self, shm_mb=64, enabled=True, noexec_binds=False, disk_mb=None,
                 probe=True):
        self.shm_bytes = str(shm_mb << 20)  # the jail's /dev/shm is memory: bounded
        # What a program may leave on disk, its /tmp and writable binds together: held here,
        # below the grader's workspace limit, so that a program that fills the disk is
        # stopped by its grader (and fails), not the grader with it by the sandbox's bound.
        self.disk_bytes = disk_mb << 20 if disk_mb else None
        self._watch = {}  # pid -> the event that stops the program's disk watcher
        self._full = {}  # pid -> what the program had written when it was stopped for it
        self.noexec_binds = noexec_binds
        self.bwrap = shutil.which("bwrap")
        self.works = False
        self._status = {}
        self._scratch = {}  # pid -> the program's /tmp on disk
        self._confined = {}  # pid -> the read end of the first stage's report
        # enabled=False (the spec's "jail": false): no jail, the tests of the fallback.
        # probe=False: the farm has seen this node's jail work (a grading that finds it
        # broken now is an error, not a run without it), and the probe's start is saved.
        if enabled and self.bwrap and os.getuid() != 0:
            # Its first stage included: where bubblewrap runs but the kernel's part cannot be
            # had, the program runs without the jail, confined all the same (no noexec).
            self.works = not probe or subprocess.run(
                self.argv([], "/", None, "/tmp") + self.stage([], None) + ["/bin/true"],
                capture_output=True, stdin=subprocess.DEVNULL, timeout=30).returncode == 0

    @property
    def name(self):
        return "bwrap" if self.works else "none"

    def argv(self, binds, cwd, status_fd, scratch):
        argv = [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net",
                "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--uid", "0",
                "--gid", "0", "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN", "--cap-add",
                "CAP_SETFCAP",
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

    def confinement(self, binds, report_fd):
        """What confine.py's ``stage0``/``confine_here`` read (:func:`stage0_args`)."""
        noexec = list(SCRATCH) + [path for path, writable in binds
                                  if writable and self.noexec_binds]
        return stage0_args(noexec, JAIL_UID, report_fd)  # noqa: F821 - included

    def stage(self, binds, report_fd):
        """The first stage's command line (confine.py's ``stage0``)."""
        source = CONFINE_SOURCE  # noqa: F821 - included
        return [sys.executable, "-I", "-S", "-c", source + "\nstage0()\n",
                *self.confinement(binds, report_fd)]

    def popen(self, argv, binds=(), cwd="/workspace", pass_fds=(), confines_itself=None,
              **kwargs):
        """``confines_itself`` (k): ``argv`` is a program that confines itself before
        anything else it runs (confine.py's ``confined_args``: no first stage, one
        interpreter start fewer), its confinement's words put after its first k (``--confine``
        and :func:`stage0_args`'s); without the jail, no words (the child is confined before
        its exec, as any)."""
        if not self.works:
            return self._start(argv, pass_fds=pass_fds, cwd=cwd,
                               preexec_fn=_confined(kwargs.pop("preexec_fn", None)), **kwargs)
        scratch = tempfile.mkdtemp(prefix="jail-")
        r, w = os.pipe()
        cr, cw = os.pipe()
        try:
            k = confines_itself
            command = (self.stage(binds, cw) + argv if k is None else
                       argv[:k] + ["--confine", *self.confinement(binds, cw)] + argv[k:])
            proc = self._start(self.argv(binds, cwd, w, scratch) + command,
                               pass_fds=(*pass_fds, w, cw), **kwargs)
        except BaseException:
            os.close(r)
            os.close(cr)
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        finally:
            os.close(w)
            os.close(cw)
        self._status[proc.pid] = r
        self._scratch[proc.pid] = scratch
        self._confined[proc.pid] = cr
        if self.disk_bytes:
            self._watch[proc.pid] = stop = threading.Event()
            threading.Thread(target=self._hold_disk, daemon=True,
                             args=(proc, scratch, [p for p, w in binds if w], stop)).start()
        return proc

    def _hold_disk(self, proc, scratch, writable, stop):
        """Measure what the program wrote and kill it past ``disk_bytes``, saying so in
        ``_full``: its /tmp every 0.05 s, less often where measuring costs over a twentieth
        of a core (this thread's CPU time, not the wall clock, which a busy machine
        stretches) but at least every 0.25 s; its writable binds, larger, every 0.2 to 2 s
        alike. Between two looks a program writes at most what the disk takes in that
        time: the bound is half the sandbox's, which holds the rest."""
        every, binds_every, binds_used, binds_at = 0.05, 0.0, 0, 0.0
        while not stop.wait(every):
            cpu = time.thread_time()
            used = disk_usage(scratch)  # noqa: F821 - included
            every = min(0.25, max(0.05, 20 * (time.thread_time() - cpu)))
            if writable and time.monotonic() - binds_at >= binds_every:
                cpu = time.thread_time()
                binds_used = sum(disk_usage(path) for path in writable)  # noqa: F821
                binds_every = min(2.0, max(0.2, 20 * (time.thread_time() - cpu)))
                binds_at = time.monotonic()
            if used + binds_used > self.disk_bytes:
                self._full[proc.pid] = {"limit_mb": self.disk_bytes >> 20,
                                        "used_mb": round((used + binds_used) / 2**20, 1)}
                for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
                    try:
                        kill()
                    except OSError:
                        pass
                return

    def filled(self, proc):
        """Whether the program was stopped for writing past ``disk_bytes`` (call before
        ``check``): ``{"limit_mb", "used_mb"}``, or None."""
        return self._full.get(proc.pid)

    @staticmethod
    def _start(argv, **kwargs):
        try:
            return subprocess.Popen(argv, **kwargs)
        except BlockingIOError as e:  # fork's EAGAIN: the process cap is full for now
            raise JailError(f"could not start the program ({e})") from None
        except subprocess.SubprocessError as e:  # the confinement before the exec failed
            raise JailError(f"could not confine the program ({e})") from None

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
        stop = self._watch.pop(proc.pid, None)
        if stop is not None:
            stop.set()
        killed = killed or self._full.pop(proc.pid, None) is not None
        scratch = self._scratch.pop(proc.pid, None)
        if scratch is not None:  # the program has ended: its /tmp goes
            shutil.rmtree(scratch, ignore_errors=True)
        report = self._confined.pop(proc.pid, None)
        said = ""
        if report is not None:
            with os.fdopen(report, "rb") as f:
                said = f.read(4096).decode(errors="replace")
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
        if said != "confined\n" and not (killed and not said):
            raise JailError(f"the program was not confined: {said.strip() or 'no word'}")


# include: ../toolserver/disk.py


def _confined(preexec_fn):
    """A ``preexec_fn`` that runs ``preexec_fn``, then confines the child (no jail)."""
    def run():
        if preexec_fn is not None:
            preexec_fn()
        confine_self()  # noqa: F821 - from confine.py
    return run
