# The kernel's part of the jail: what no program under test needs, refused by the kernel
# itself, so that no spelling of a path, no native code and no second process gets around
# it. Included into a grader script where it says "# include: confine.py" (after jail.py's
# imports); ``confine_self`` runs in the program's own process before it executes the
# program (the jail's first stage, or a jail-less child before its exec), or before it runs
# the program itself (``confine_here``: the call server, one interpreter instead of two):
#
# - ``noexec`` (jail only): the writable mounts the program sees (the repository, its /tmp,
#   /dev/shm, /run, /workspace) are remounted noexec, nosuid, nodev (``mount_setattr``, as
#   the jail's own root, before giving that up): no file the candidate wrote or the run
#   writes can be executed or mapped executable, so no native code of the candidate's
#   loads (``dlopen`` fails with EPERM).
# - the user: a user namespace of its own in which the program is JAIL_UID, with no
#   capability: every one dropped (``capset``, and from the bounding set) and checked gone
#   before anything of the program runs, whether it is then executed or not.
# - Landlock: every file system right on every top-level directory but /proc; in /proc only
#   the node's own descriptions (cpuinfo, meminfo, ...) and the program's own harmless
#   files (status, stat, maps, ...); any directory may be listed. ``/proc/*/mem`` (by any spelling:
#   ``/dev/fd/../mem``, a ``dir_fd`` of ``/proc/self``), ``environ`` of other processes,
#   ``pagemap`` and every other process's files are refused by the kernel.
# - seccomp: ``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd``, ``kcmp``,
#   ``userfaultfd``, ``perf_event_open``, ``bpf``, io_uring, every mount call and every
#   new namespace (``unshare``, ``clone`` with namespace flags, ``setns``; ``clone3`` says
#   ENOSYS so that the C library falls back to ``clone``) fail with EPERM, as does any
#   system call of another ABI (i386, x32).
# - no new privileges (set-user-ID files and file capabilities grant nothing).
#
# Where Landlock or seccomp cannot be applied, ``confine_self`` raises OSError: grading
# without the kernel's boundary would be grading on trust (the caller reports an error).

import ctypes
import os
import stat
import struct
import sys

PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
CAPABILITY_VERSION_3 = 0x20080522
PR_SET_SECCOMP = 22
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 0x2, 0x4, 0x8
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
CLONE_NEWUSER = 0x10000000
NAMESPACES = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
              | 0x40000000 | 0x00000080)  # mnt cgroup uts ipc user pid net time
EPERM, ENOSYS = 1, 38
PROT_EXEC, MAP_ANONYMOUS = 0x4, 0x20

# The numbers the generic table gives every machine alike (those added since Linux 5.0).
_GENERIC = dict(pidfd_getfd=438, io_uring_setup=425, io_uring_enter=426, io_uring_register=427,
                open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
                fspick=433, mount_setattr=442, clone3=435, memfd_secret=447,
                landlock_create_ruleset=444, landlock_add_rule=445,
                landlock_restrict_self=446)
# (audit arch, {name: number}) per machine: the calls refused, and those looked at.
_CALLS = {
    "x86_64": (0xC000003E, dict(
        _GENERIC, ptrace=101, process_vm_readv=310, process_vm_writev=311, kcmp=312,
        userfaultfd=323, perf_event_open=298, bpf=321, mount=165, umount2=166,
        pivot_root=155, setns=308, unshare=272, clone=56, memfd_create=319, mmap=9,
        mprotect=10, pkey_mprotect=329, capset=126)),
    "aarch64": (0xC00000B7, dict(
        _GENERIC, ptrace=117, process_vm_readv=270, process_vm_writev=271, kcmp=272,
        userfaultfd=282, perf_event_open=241, bpf=280, mount=40, umount2=39, pivot_root=41,
        setns=268, unshare=97, clone=220, memfd_create=279, mmap=222, mprotect=226,
        pkey_mprotect=288, capset=91)),
}
REFUSED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
           "userfaultfd", "perf_event_open", "bpf", "io_uring_setup", "io_uring_enter",
           "io_uring_register", "mount", "umount2", "pivot_root", "setns", "open_tree",
           "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
           "memfd_create", "memfd_secret")

# In /proc: the node's descriptions, and the program's own harmless files.
PROC_NODE = ("cpuinfo", "meminfo", "stat", "loadavg", "uptime", "version", "filesystems",
             "sys")
PROC_SELF = ("status", "stat", "statm", "cmdline", "comm", "limits", "mounts", "mountinfo",
             "maps", "cgroup", "io")
PROC_SELF_DIRS = ("fd", "fdinfo")  # listed only: opening /proc/self/fd/N re-opens the file
# Landlock's file system rights, by the ABI version that brought them.
_FS_RIGHTS = {1: (1 << 13) - 1, 2: 1 << 13, 3: 1 << 14, 5: 1 << 15}
_FILE_RIGHTS = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # execute, write, read, truncate, ioctl
_READ, _READ_DIR = 4 | 8, 8  # read a file or a directory; list a directory
_SCOPES = 1 | 2  # (ABI 6) abstract unix sockets and signals: only within the domain


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _fail(what):
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def _calls():
    machine = os.uname().machine
    if machine not in _CALLS:
        raise OSError(ENOSYS, f"no system call table for {machine}")
    return _CALLS[machine]


def seccomp_program():
    """The filter (classic BPF, ``struct sock_filter`` packed) that refuses what no test
    needs; everything else is allowed."""
    arch, nr = _calls()
    args = [16 + 8 * i for i in range(6)]  # seccomp_data.args[i], its low 32 bits
    prog = [("ld", 4), ("jeq", arch, None, "deny"), ("ld", 0),
            ("jge", 0x40000000, "deny", None)]
    prog += [("jeq", nr[name], "deny", None) for name in REFUSED]
    prog += [("jeq", nr["clone3"], "nosys", None),
             ("jeq", nr["unshare"], "namespaces", None), ("jeq", nr["clone"], "namespaces", None),
             ("jeq", nr["mmap"], "mmap", None), ("jeq", nr["mprotect"], "mprotect", None),
             ("jeq", nr["pkey_mprotect"], "mprotect", None), ("ret", "allow"),
             ("label", "namespaces"), ("ld", args[0]), ("jset", NAMESPACES, "deny", None),
             ("ret", "allow"),
             # New machine code: memory mapped executable but from no file, or made
             # executable after the fact (a file's mapping is the mount's to allow: noexec).
             ("label", "mmap"), ("ld", args[2]), ("jset", PROT_EXEC, None, "allow"),
             ("ld", args[3]), ("jset", MAP_ANONYMOUS, "deny", None), ("ret", "allow"),
             ("label", "mprotect"), ("ld", args[2]), ("jset", PROT_EXEC, "deny", None),
             ("ret", "allow"),
             ("label", "deny"), ("ret", "deny"), ("label", "nosys"), ("ret", "nosys"),
             ("label", "allow"), ("ret", "allow")]
    where, i = {}, 0
    for p in prog:
        if p[0] == "label":
            where[p[1]] = i
        else:
            i += 1
    rets = {"deny": 0x00050000 | EPERM, "nosys": 0x00050000 | ENOSYS, "allow": 0x7FFF0000}
    out = b""
    for i, p in enumerate(p for p in prog if p[0] != "label"):
        if p[0] == "ld":
            out += struct.pack("=HBBI", 0x20, 0, 0, p[1])
        elif p[0] == "ret":
            out += struct.pack("=HBBI", 0x06, 0, 0, rets[p[1]])
        else:
            op = {"jeq": 0x15, "jge": 0x35, "jset": 0x45}[p[0]]
            jt, jf = ((where[t] - i - 1) if t else 0 for t in p[2:])
            out += struct.pack("=HBBI", op, jt, jf, p[1])
    return out


def _seccomp(libc):
    prog = seccomp_program()
    n = len(prog) // 8
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("=HxxxxxxQ", n, ctypes.addressof(buf))  # struct sock_fprog
    fbuf = ctypes.create_string_buffer(fprog)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fbuf, 0, 0) != 0:
        _fail("seccomp")


def _landlock(libc):
    nr = _calls()[1]
    abi = libc.syscall(nr["landlock_create_ruleset"], None, 0, 1)
    if abi < 1:
        _fail("Landlock")
    handled = sum(bits for v, bits in _FS_RIGHTS.items() if v <= abi)
    attr = struct.pack("=QQQ", handled, 0, _SCOPES if abi >= 6 else 0)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = libc.syscall(nr["landlock_create_ruleset"], ctypes.c_char_p(attr[:size]),
                           ctypes.c_size_t(size), 0)
    if ruleset < 0:
        _fail("Landlock ruleset")

    def allow(path, rights):
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            rights &= handled if is_dir else (handled & _FILE_RIGHTS)
            rule = struct.pack("=Qi", rights, fd)
            if libc.syscall(nr["landlock_add_rule"], ruleset, 1, ctypes.c_char_p(rule),
                            0) != 0:
                _fail(f"Landlock rule for {path}")
        finally:
            os.close(fd)

    try:
        allow("/", _READ_DIR)  # every directory may be listed (/ itself: tools walk up to it)
        for name in os.listdir("/"):
            if name != "proc":
                allow("/" + name, handled)
        for name in PROC_NODE:
            allow("/proc/" + name, _READ)
        me = os.getpid()
        for name in PROC_SELF:
            allow(f"/proc/{me}/{name}", _READ)
        for name in PROC_SELF_DIRS:
            allow(f"/proc/{me}/{name}", _READ_DIR)
        if libc.syscall(nr["landlock_restrict_self"], ruleset, 0) != 0:
            _fail("Landlock restrict")
    finally:
        os.close(ruleset)


def _noexec(libc, paths):
    attr = ctypes.create_string_buffer(struct.pack(
        "=QQQQ", MOUNT_ATTR_NOEXEC | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0))
    for path in paths:
        if libc.syscall(_calls()[1]["mount_setattr"], AT_FDCWD, path.encode(), AT_RECURSIVE,
                        attr, 32) != 0:
            _fail(f"noexec on {path}")


def _own_user(libc, uid):
    """A user namespace of our own in which we are ``uid`` and hold no capability once we
    execute (we were the jail's root: bubblewrap gave us CAP_SETFCAP too, which the kernel
    asks of a parent whose root the new namespace maps)."""
    outer, group = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER) != 0:
        _fail("user namespace")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {outer} 1"),
                       ("gid_map", f"{uid} {group} 1")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def _no_capabilities(libc):
    """Every capability of this process gone for good: the bounding set emptied while it
    may be (CAP_SETPCAP), then the permitted, effective and inheritable sets; checked."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM where none was held: no matter
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = ctypes.create_string_buffer(struct.pack("=Ii", CAPABILITY_VERSION_3, 0))
    data = ctypes.create_string_buffer(bytes(24))  # two {effective, permitted, inheritable}
    if libc.syscall(_calls()[1]["capset"], header, data) != 0:
        _fail("dropping the capabilities")
    with open("/proc/self/status") as f:
        left = [line.split(":")[0] for line in f
                if line.startswith(("CapInh:", "CapPrm:", "CapEff:", "CapAmb:"))
                and int(line.split()[1], 16)]
    if left:
        raise OSError(EPERM, f"capabilities left: {', '.join(left)}")


def confine_self(noexec=(), uid=None):
    """Confine this process and whatever it executes (see the top of this file)."""
    libc = _libc()
    if noexec:
        _noexec(libc, noexec)
    if uid is not None:
        _own_user(libc, uid)
    _no_capabilities(libc)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail("no new privileges")
    _landlock(libc)
    _seccomp(libc)


def stage0_args(noexec=(), uid=None, report=None):
    """What stage0 reads before the program's argv (plain words: a first stage that imported
    json, or platform, would start a fifth slower)."""
    return ["" if uid is None else str(uid), "" if report is None else str(report),
            str(len(noexec)), *noexec]


def confine_here(words):
    """Confine this process as stage0 does (``words``: :func:`stage0_args`), say so on the
    ``report`` descriptor and close it; then the caller runs the program itself. If it
    cannot, it says why there (and on stderr) and exits 125: the program never runs."""
    uid, report, n = words[:3]
    uid = int(uid) if uid else None
    report = int(report) if report else None
    try:
        confine_self(words[3:3 + int(n)], uid)
    except OSError as e:
        if report is not None:
            os.write(report, f"cannot confine the program: {e}\n".encode())
        sys.stderr.write(f"prorl-jail: cannot confine the program: {e}\n")
        os._exit(125)
    if report is not None:  # said before the program runs; it never holds this pipe
        os.write(report, b"confined\n")
        os.close(report)
    return words[3 + int(n):]


def confined_args(args):
    """A self-confining program's arguments (its ``sys.argv[1:]``): those after its
    confinement's words, once it is confined (``--confine`` WORDS..., put there by the jail);
    as they are without them (no jail: it was confined before its exec)."""
    return confine_here(args[1:]) if args[:1] == ["--confine"] else args


def run_here():
    """``python3 -I -c SOURCE+'run_here()' [--confine WORDS...] SCRIPT ARGS...``: confined, it
    runs SCRIPT in this interpreter as ``python3 -I SCRIPT ARGS`` would (a ``__main__``
    module of its own, ``sys.argv`` from SCRIPT), without a first stage's interpreter."""
    import types

    argv = confined_args(sys.argv[1:])
    main = types.ModuleType("__main__")
    main.__file__ = argv[0]
    sys.modules["__main__"] = main
    sys.argv = argv
    with open(argv[0], "rb") as f:
        code = compile(f.read(), argv[0], "exec")
    exec(code, main.__dict__)


def stage0():
    """The jail's first stage, as ``python3 -I -S -c SOURCE+'stage0()' UID REPORT N
    PATH*N ARGV...`` (:func:`stage0_args`): confined (:func:`confine_here`), it executes
    ARGV."""
    argv = confine_here(sys.argv[1:])
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f"prorl-jail: cannot execute {argv[0]}: {e}\n")
        os._exit(127)
