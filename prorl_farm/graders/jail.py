# The jail: a nested sandbox for the program under test, inside a grader's sandbox.
# Included into a grader script where it says "# include: jail.py" (graders run isolated,
# with nothing importable beside them).

import os

JAIL_UID = 1001  # inside the jail's own user namespace: not the grader's uid there


class Jail:
    """``command(argv, binds)`` runs ``argv`` in a nested bubblewrap sandbox: its own user,
    pid, mount, network, IPC and UTS namespaces, no capabilities, the grader's root
    read-only, fresh ``/proc``, ``/dev``, ``/tmp`` and ``/run``, an empty ``/workspace``
    holding only ``binds`` (``(path, writable)``, at the same path), dying with its
    parent. From inside, the grader's processes cannot be seen or signalled, and nothing
    of the grader's sandbox but the read-only system and the binds can be read. Where the
    jail cannot be made (no bubblewrap, or no user namespaces here), ``command`` returns
    ``argv`` as it is and ``name`` is ``"none"``."""

    def __init__(self):
        import shutil
        import subprocess

        self.bwrap = shutil.which("bwrap")
        self.works = False
        if self.bwrap and os.getuid() != 0:
            probe = subprocess.run(self.argv([], "/") + ["/bin/true"], capture_output=True,
                                   stdin=subprocess.DEVNULL, timeout=30)
            self.works = probe.returncode == 0

    @property
    def name(self):
        return "bwrap" if self.works else "none"

    def argv(self, binds, cwd):
        argv = [self.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net",
                "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--uid",
                str(JAIL_UID), "--gid", str(JAIL_UID), "--cap-drop", "ALL",
                "--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--proc", "/proc",
                "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run", "--tmpfs", "/workspace"]
        for path, writable in binds:
            argv += ["--bind" if writable else "--ro-bind", path, path]
        return argv + ["--chdir", cwd, "--"]

    def command(self, argv, binds=(), cwd="/workspace"):
        return (self.argv(binds, cwd) + argv) if self.works else argv
