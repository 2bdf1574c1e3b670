"""Grade a submitted program against hidden tests; the verdict is one line of this process
tagged with a nonce.

Run as ``python3 -I -S code_harness.py`` in a fresh sandbox holding ``solution.py`` and this
file, nothing else. The tests come on stdin (JSON: ``nonce``, ``style``, the tests, limits),
read whole before any candidate code runs, and live only in this process's memory: no file
in the sandbox holds them. This process is not dumpable (no ptrace, no reading of its
memory, fds or environment by a process of the same user).

The candidate runs in a process of its own, started with only what it needs, inside a
nested sandbox (the *jail*: bubblewrap with its own user, pid, mount, network and IPC
namespaces, an empty writable ``/workspace`` holding ``solution.py`` read-only, fresh
``/tmp``): it cannot see this process, signal it, or read anything it holds. Where the
jail cannot be made (no bubblewrap or no user namespaces inside the sandbox), the candidate
is a plain child, and the tests are still out of its reach; the verdict says which
(``jail``).

- stdio tests: per test, the program runs with that test's input on its stdin under time,
  memory and file-size limits; this process compares the output it captured. The time
  limit is CPU time of all the program's processes (read from ``/proc`` as it runs), so a
  busy machine does not fail a right program; a wall-clock backstop (``wall_s``, by default
  ``WALL_FACTOR`` times the limit) stops one that only waits. The program
  never sees another test's input or any expected output.
- call tests (HumanEval/MBPP style): the program is loaded in the jail by a small server
  (``call_server.py``) that answers questions over a pipe. The test code (trusted) runs
  here, with ``candidate`` and the entry point bound to that pipe, and, as HumanEval's and
  MBPP's own harnesses give them, the program's top-level names the test code uses: its
  functions and classes (called through the same pipe; an exception class stands here as a
  class of its built-in base), the modules it imported (imported here by name) and its
  constants. Values cross as typed descriptions (``values.py``) rebuilt here from trusted
  types only: sets, the ``collections`` types, ``Decimal``, ``Fraction``, big ints, inf
  and nan, bytes...; what has none (an instance of the program's class, a function or an
  iterator it returns) stays in the jail as a reference whose every use is a question to
  it, and is never equal to a value of the test's (the program's ``__eq__`` is asked only
  about two of its own objects). A call that changes a list, dict or set argument changes
  the test's own. An exception the program raises is raised here by its built-in type
  (``StopIteration`` and ``SystemExit`` as an error of the call). The cases of a problem
  share one program, as their harnesses run them in one process. The test setup's own
  definitions and Python's builtins are never replaced by the program's. A returned object
  with a rigged ``__eq__``, a patched ``assert``/``unittest``/``pytest``, an early
  ``os._exit(0)`` or printed fake results cannot pass a test. Of the modules a program
  imported, only those whose import does nothing but define names (``PURE_MODULES``) are
  imported here: a name bound to ``unittest.__main__`` (which exits when imported) is left
  out. Whatever the program makes this process raise (``SystemExit`` and every other
  ``BaseException`` included) fails that test with the reason: a wrong program earns 0,
  never an error. What the program writes is read as JSON, here if its line is short and
  past a check in a child process of bounded memory if it is long (``Literals``): a
  value's objects can take 25 times its text's size.
- stdio output is judged by the task's checker: the same words however spaced (``tokens``,
  the default), the same lines (``exact``), numbers within a tolerance (``floats``), or
  the task's own checker program run in the jail (``program``: exit status 0 accepts).

After each test every other process of the sandbox's user is killed and reaped (this process
is their subreaper) before the next starts: the process cap counts a task until it is reaped,
so a fork bomb torn down slowly would otherwise leave the next test no process to start.
Exit status 0 and
one line ``NONCE {"passed", "total", "jail", "results": [{"ok", "why"}]}``.
"""

import builtins
import collections
import ctypes
import importlib
import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
SOLUTION = "solution.py"
MAX_LINE = 4 * 1024 * 1024  # one line from the program (a result, its names), at most
PARSER_MB = 1024  # the literal reader's address space
WALL_FACTOR = 10  # a test's wall-clock backstop, in times its CPU time limit (unless given)
CHILD_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}
# Modules whose import only defines names: test code may use these from a program's imports.
PURE_MODULES = frozenset({
    "abc", "array", "bisect", "calendar", "cmath", "collections", "collections.abc",
    "copy", "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions",
    "functools", "hashlib", "heapq", "itertools", "json", "math", "numbers", "operator",
    "random", "re", "statistics", "string", "struct", "sys", "textwrap", "typing",
    "unicodedata", "zlib"})


def harden():
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        # A killed jail's own init (and whatever else our children leave) is re-parented to
        # this process, which reaps it at once in kill_others().
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def limits(memory_mb, file_mb=64):
    def apply():
        os.setsid()
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


SERVER = set()  # a warm grader's own process (serve): kept by the gradings it forks


def kill_others(within_s=30.0):
    """Every process but this one, its literal reader and the sandbox's init: what a test
    left behind, killed, and waited for until it is reaped (until then the process cap
    still counts it), at most ``within_s``. The zombies of the sandbox's init (its shell,
    killed here too) are its own to reap, not waited for. Only inside a sandbox (never as
    root, where "every process" would be the host's)."""
    if os.getuid() == 0:
        return
    keep = {os.getpid(), 1, LITERALS.pid} | SERVER
    end = time.monotonic() + within_s
    pause = 0.005
    while True:
        left = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            pid = int(name)
            try:
                os.kill(pid, signal.SIGKILL)
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state, ppid = f.read().rpartition(b")")[2].split()[:2]
            except (ProcessLookupError, PermissionError, FileNotFoundError, ValueError):
                continue
            ppid = int(ppid)
            if state == b"Z" and (ppid == 1 or ppid in SERVER):
                continue  # the init's to reap, or the warm grader's (after this grading)
            if ppid == os.getpid() and _reaped(pid, end):
                continue  # ours (a child, or an orphan we adopted): reaped as it died
            left = True
        if not left or time.monotonic() > end:
            return
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def _reaped(pid, end):
    """Whether our killed child ``pid`` died and was reaped by ``end`` (its death waited for,
    not slept on)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        fd = None
    try:
        if fd is not None:
            select.select([fd], [], [], max(0.0, end - time.monotonic()))
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True
    finally:
        if fd is not None:
            os.close(fd)


# include: jail.py
# include: values.py
# include: ending.py


# The size check: reads a length-prefixed text, answers ``o`` + the bytes its JSON value would
# take as Python objects, ``m`` (over its memory bound) or ``e`` + the error's name,
# length-prefixed.
PARSER = r"""
import ctypes, json, struct, sys
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
inp, out = sys.stdin.buffer, sys.stdout.buffer
size = sys.getsizeof
while True:
    head = inp.read(8)
    if len(head) < 8:
        break
    data = inp.read(struct.unpack("<Q", head)[0])
    try:
        todo, total = [json.loads(data)], 0
        while todo:
            node = todo.pop()
            total += size(node) + 8
            if type(node) is list:
                todo.extend(node)
            elif type(node) is dict:
                todo.extend(node)
                todo.extend(node.values())
        blob = b"o" + str(total).encode()
    except MemoryError:
        blob = b"m"
    except BaseException as e:
        blob = b"e" + type(e).__name__.encode()
    data = todo = node = None
    out.write(struct.pack("<Q", len(blob)) + blob)
    out.flush()
"""
IN_PROCESS_BYTES = 256 * 1024  # a line this long is read here at once: at most ~25x in memory
DECODE_BYTES = 24 << 20  # what a longer line may take as Python objects


class Literals:
    """The program's JSON lines, read safely: a short line here, a long one only once a child
    process of bounded memory (``PARSER_MB``) has read it and found it takes at most
    ``DECODE_BYTES`` as Python objects (``json.loads`` can take 25 times its input's size);
    ``read(text)`` returns the JSON value or raises ``ValueError`` with the reason."""

    def __init__(self, memory_mb=PARSER_MB):
        self.memory_mb = memory_mb
        self.proc = None

    def read(self, text):
        if len(text) > IN_PROCESS_BYTES:
            self._check(text)
        try:
            return json.loads(text)
        except RecursionError:
            raise ValueError("a value nested too deep") from None
        except ValueError as e:
            raise ValueError(f"not a value ({type(e).__name__})") from None

    def _check(self, text):
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", PARSER],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, close_fds=True,
                                         preexec_fn=limits(self.memory_mb))
        data = text.encode("utf-8", errors="replace")
        try:
            self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
            self.proc.stdin.flush()
            head = self.proc.stdout.read(8)
            blob = self.proc.stdout.read(struct.unpack("<Q", head)[0]) \
                if len(head) == 8 else b""
        except (OSError, ValueError):
            blob = b""
        if blob[:1] == b"o" and int(blob[1:]) <= DECODE_BYTES:
            return
        if blob[:1] == b"e":
            raise ValueError(f"not a value ({blob[1:].decode(errors='replace')})")
        if blob[:1] != b"o":
            self.close()
        raise ValueError("a value too large to read within its memory bound")

    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None

    def close(self):
        if self.proc is not None:
            end_process(self.proc)  # noqa: F821 - included
            self.proc = None


LITERALS = Literals()


def binds(where):
    """The jail's view for the program, as ``(binds, cwd)``: its directory (a private copy
    of the program, and nothing else), read-only; it writes to its own fresh ``/tmp``; and
    a warm grader's compiled jail helpers, read-only."""
    return [(where, False)] + ([(HELPERS_DIR, False)] if HELPERS_DIR else []), where


def helper(module, call, text):
    """The ``-c`` text that runs ``call`` of a jail helper: imported from a warm grader's
    compiled copy, else its ``text`` compiled here and now."""
    if HELPERS_DIR:
        return (f"import sys; sys.path.insert(0, {HELPERS_DIR!r}); import {module}; "
                f"{module}.{call}()")
    return text + f"\n{call}()\n"


def normalise(text):
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def run_jailed(jail, argv, view, data, bound, time_s, wall_s, memory_mb, confines_itself=None):
    """A program in the jail with ``data`` on its stdin, its output read here up to
    ``bound``: ``(output, why, exit status)``, ``why`` None unless a limit stopped it."""
    proc = jail.popen(argv, *view, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=subprocess.DEVNULL, close_fds=True, confines_itself=confines_itself,
                      preexec_fn=limits(memory_mb), env=CHILD_ENV)
    why = "not run"
    try:
        out, why = collect(proc, data, bound, Clock(proc.pid, time_s, wall_s))
        if jail.filled(proc):
            why = "disk limit"
    finally:
        end_process(proc)  # noqa: F821 - included
        jail.check(proc, killed=why is not None)
    return out, why, proc.returncode


def run_stdio(jail, where, test, time_s, wall_s, memory_mb, checker):
    """One test: the program with the test's input on its stdin; its output read here up to
    a bound (four times the expected output, at least 1 MiB: a program that floods its
    stdout is stopped, not buffered), then judged by the task's ``checker``."""
    bound = max(1 << 20, 4 * len(test["output"].encode()))
    # The program runs as python3 -I solution.py, in the interpreter that confines it.
    out, why, status = run_jailed(
        jail, [sys.executable, "-I", "-c", helper("prorl_confine", "run_here", CONFINE_SOURCE),  # noqa: F821
               SOLUTION],
        binds(where), test["input"].encode(), bound, time_s, wall_s, memory_mb,
        confines_itself=4)
    if why is not None:
        return False, why
    if status != 0:
        return False, f"exit status {status}"
    text = out.decode("utf-8", errors="replace")
    if checker.get("kind") == "program":
        return judged(jail, test, text, checker, time_s, wall_s, memory_mb)
    ok = matches(text, test["output"], checker)
    return ok, "ok" if ok else "wrong output"


def matches(out, expected, checker):
    """Whether ``out`` is the expected output by the checker's rule: ``exact`` (lines with
    their trailing blanks and the trailing blank lines taken off), ``tokens`` (the same
    words, however spaced: the default) or ``floats`` (the same words, numbers within an
    absolute or a relative tolerance, as competitive programming's checkers judge)."""
    kind = checker.get("kind", "tokens")
    if kind == "exact":
        return normalise(out) == normalise(expected)
    got, want = out.split(), expected.split()
    if kind != "floats" or len(got) != len(want):
        return got == want
    tolerance = float(checker.get("tolerance", 1e-6))
    for g, w in zip(got, want):
        if g == w:
            continue
        try:
            gv, wv = float(g), float(w)
        except ValueError:
            return False
        if not (abs(gv - wv) <= max(tolerance, tolerance * abs(wv))):  # nan never is
            return False
    return True


CHECKER = "checker.py"


class CheckerError(RuntimeError):
    """The task's checker failed to judge (the task's fault, never the program's): the
    grading is an error, not a zero."""


def judged(jail, test, out, checker, time_s, wall_s, memory_mb):
    """The task's own checker program (a special judge), run in the jail as ``python3
    checker.py input output answer`` in a directory holding the test's input, the program's
    output and the expected answer: exit status 0 accepts. It never sees another test."""
    where = tempfile.mkdtemp(prefix="checker-")
    try:
        for name, text in ((CHECKER, checker["program"]), ("input", test["input"]),
                           ("output", out), ("answer", test["output"])):
            with open(os.path.join(where, name), "w") as f:
                f.write(text)
        os.chmod(where, 0o755)
        for name in os.listdir(where):
            os.chmod(os.path.join(where, name), 0o644)
        said, why, status = run_jailed(
            jail, [sys.executable, "-I", CHECKER, "input", "output", "answer"], binds(where),
            b"", 1 << 16, time_s, wall_s, memory_mb)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if why is not None:
        raise CheckerError(f"the task's checker did not finish ({why})")
    if status != 0:
        return False, "wrong output (the task's checker: " + \
            said.decode("utf-8", "replace").strip()[:200] + ")"
    return True, "ok"


def collect(proc, data, bound, clock):
    """Feed ``data`` to the program's stdin and read its stdout until it closes; returns
    (output, None) or (b"", why) past the ``clock``'s limits or the bound."""
    out, view = [], memoryview(data)
    size = 0
    stdin, stdout = proc.stdin.fileno(), proc.stdout.fileno()
    os.set_blocking(stdin, False)
    writing = [stdin] if data else []
    if not data:
        proc.stdin.close()
    while True:
        why = clock.over()
        if why is not None:
            return b"", why
        readable, writable, _ = select.select([stdout], writing, [], clock.wait_s())
        if writable:
            try:
                view = view[os.write(stdin, view[:65536]):]
            except (BrokenPipeError, BlockingIOError):
                view = view[:0]
            if not view:
                writing = []
                proc.stdin.close()
        if readable:
            chunk = os.read(stdout, 65536)
            if not chunk:
                break
            size += len(chunk)
            if size > bound:
                return b"", "output limit"
            out.append(chunk)
    while True:  # its stdout is closed: it may still run
        try:
            proc.wait(timeout=clock.wait_s())
            return b"".join(out), None
        except subprocess.TimeoutExpired:
            why = clock.over()
            if why is not None:
                return b"", why


TICKS = os.sysconf("SC_CLK_TCK")
POLL_S = 0.1  # how often a running test's CPU time is read


def tree_cpu_s(root):
    """CPU seconds (user and system) of process ``root`` and of every process below it, with
    what they have reaped: all that a test's program spent, in however many processes."""
    stats, below = {}, {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rindex(b")") + 2:].split()
        pid, ppid = int(name), int(rest[1])
        stats[pid] = sum(int(x) for x in rest[11:15])  # utime stime cutime cstime
        below.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid]
            todo.extend(below.get(pid, ()))
    return total / TICKS


class Clock:
    """A test's limits: ``cpu_s`` of CPU time for the program's processes (what a time limit
    means: a right program is not failed because the machine is busy), and ``wall_s`` of
    wall clock, a backstop for a program that waits rather than computes."""

    def __init__(self, root, cpu_s, wall_s):
        self.root, self.cpu_s = root, cpu_s
        self.spent = tree_cpu_s(root)
        self.deadline = time.monotonic() + wall_s

    def wait_s(self):
        """How long to wait for the program before the limits are read again."""
        return max(0.0, min(POLL_S, self.deadline - time.monotonic()))

    def over(self):
        """Why the program is stopped ("time limit"), or None while it is within both."""
        if tree_cpu_s(self.root) - self.spent > self.cpu_s:
            return "time limit"
        if time.monotonic() >= self.deadline:
            return "time limit (wall clock)"
        return None


# The program's side of call tests (call_server.py, with values.py in it).
# include-text: call_server.py CALL_SERVER


class ProgramExit(Exception):
    """The program raised what is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``):
    here, an error of the call like any other, never this process's exit."""


_CONTROL = (StopIteration, StopAsyncIteration)


class ProgramBroken(RuntimeError):
    """The program's answers are out of step with the questions (it died, timed out during a
    question or wrote what is not an answer): it is restarted for the next test."""


def _exception_class(name, base, cache, key):
    """A trusted class standing for the program's exception class ``name`` (its built-in
    base ``base``): ``except ValueError`` catches it when the program's subclasses it."""
    builtin = getattr(builtins, base, None)
    if not (isinstance(builtin, type) and issubclass(builtin, BaseException)):
        builtin = Exception
    if not issubclass(builtin, Exception) or issubclass(builtin, _CONTROL):
        # SystemExit, KeyboardInterrupt, GeneratorExit; and StopIteration, which would end
        # the test's own loop early (all(map(check, cases)) of no case is True)
        builtin = ProgramExit
    if key not in cache:
        safe = name if _IDENT.match(name or "") else "ProgramError"
        cache[key] = type(safe, (builtin,), {"__module__": "solution"})
    return cache[key]


class Remote:
    """A value of the program's that has no description (an instance of its own class, a
    function or class of its, an iterator): it stays in the jail, and each use is a question
    to it. Compared with a value of the test's own, it is never equal (nor ordered): the
    program's ``__eq__`` (and ``__contains__``) is asked only about two of its own objects,
    never to judge a value the test holds."""

    __slots__ = ("_program", "_id", "_kind", "_name", "_buffer", "_done")
    _OWN = frozenset(__slots__)

    def __init__(self, program, ident, kind, name):
        self._program, self._id, self._kind, self._name = program, ident, kind, name
        self._buffer, self._done = [], False

    def _op(self, op, *args):
        return self._program.ask(["op", op, self._id, [self._program.encode(a) for a in args]])

    def _mine(self, other):
        return isinstance(other, Remote) and other._program is self._program

    def _compare(self, op, other):
        if not self._mine(other):
            return NotImplemented
        return self._op(op, other)

    def __eq__(self, other):
        return self._compare("eq", other)

    def __ne__(self, other):
        return self._compare("ne", other)

    def __lt__(self, other):
        return self._compare("lt", other)

    def __le__(self, other):
        return self._compare("le", other)

    def __gt__(self, other):
        return self._compare("gt", other)

    def __ge__(self, other):
        return self._compare("ge", other)

    def __hash__(self):
        value = self._op("hash")
        if type(value) is not int:
            raise TypeError("the program's hash is not an int")
        return value

    def __len__(self):
        value = self._op("len")
        if type(value) is not int or value < 0:
            raise TypeError("the program's length is not an int")
        return value

    def __bool__(self):
        value = self._op("bool")
        if type(value) is not bool:
            raise TypeError("the program's truth is not a bool")
        return value

    def __contains__(self, item):
        if self._mine(item):
            return self._op("contains", item) is True
        # About a value of the test's, the program is not asked (its __contains__ could say
        # yes to anything): its items are, compared here.
        return any(v is item or v == item for v in self)

    def __getitem__(self, key):
        return self._op("getitem", key)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._op("getattr", name)

    def __setattr__(self, name, value):  # root.left = Node(2) in a test's setup
        if name in Remote._OWN:
            object.__setattr__(self, name, value)
        elif name.startswith("__"):
            raise AttributeError(name)
        else:
            self._op("setattr", name, value)

    def __setitem__(self, key, value):
        self._op("setitem", key, value)

    def __delitem__(self, key):
        self._op("delitem", key)

    def __call__(self, *args, **kwargs):
        return self._program.call(self._id, args, kwargs)

    def __iter__(self):
        return self if self._kind == "iterator" else iter(self._op("iter"))

    def __next__(self):
        if not self._buffer and not self._done:
            self._buffer, self._done = self._program.next_items(self._id)
            self._buffer.reverse()
        if not self._buffer:
            raise StopIteration
        return self._buffer.pop()

    def __instancecheck__(self, value):
        return self._mine(value) and self._program.ask(
            ["op", "isinstance", value._id, [self._program.encode(self)]]) is True

    def __str__(self):
        value = self._op("str")
        return value if type(value) is str else repr(self)

    def __repr__(self):
        return f"<the program's {self._name}>"


class Program:
    """The program, loaded in the jail; the test's calls and every use of what it returns
    are questions to it on a pipe, and its answers descriptions of values."""

    def __init__(self, jail, where, entry_point, time_s, wall_s, memory_mb):
        self.time_s, self.wall_s = time_s, wall_s
        self.broken = False
        self.exceptions = {}  # the program's exception classes, as this side stands for them
        r, w = os.pipe()
        self.jail = jail
        view, cwd = binds(where)
        self.proc = jail.popen(
            [sys.executable, "-I", "-c", helper("prorl_call_server", "main", CALL_SERVER),  # noqa: F821
             entry_point, str(w)], view, cwd, confines_itself=4,
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(w,), close_fds=True, preexec_fn=limits(memory_mb), env=CHILD_ENV)
        os.close(w)
        self.results = os.fdopen(r, "rb")
        self.checked = False
        try:
            first = self._message()
        except RuntimeError as e:
            if str(e) != "the program exited":
                self.close()  # it may still be writing: it goes before the error is told
                raise
            self.proc.wait()  # it exited: the program's doing, or the jail's?
            self.checked = True
            self.results.close()
            jail.check(self.proc)
            raise
        except BaseException:
            self.close()
            raise
        try:
            if first[:1] == ["fail"]:
                raise RuntimeError(f"the program did not load ({str(first[1:])[:200]})")
            if first[:1] != ["ready"] or len(first) != 2 or not isinstance(first[1], dict):
                raise RuntimeError("the program did not load (bad name table)")
            self.names = first[1]
        except BaseException:
            self.close()
            raise

    def _read(self):
        """The program's next line, within the limits of one call (or of its loading)."""
        clock = Clock(self.proc.pid, self.time_s, self.wall_s)
        while not select.select([self.results], [], [], clock.wait_s())[0]:
            why = clock.over()
            if why is not None:
                raise TimeoutError(why)
        line = self.results.readline(MAX_LINE)
        if not line and self.jail.filled(self.proc):
            raise RuntimeError("the program wrote past the disk limit")
        if not line:
            raise RuntimeError("the program exited")
        if not line.endswith(b"\n"):
            raise RuntimeError("a result over the size limit")
        return line.decode("utf-8", errors="replace").rstrip("\n")

    def _message(self):
        message = LITERALS.read(self._read())
        if not isinstance(message, list) or not message or not isinstance(message[0], str):
            raise ValueError("not an answer")
        return message

    def _exchange(self, request):
        """Ask, and read the answer; past any failure in between, the program is broken."""
        if self.broken:
            raise ProgramBroken("the program stopped answering")
        line = line_of(request)  # noqa: F821 - values.py's
        self.broken = True
        try:
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise RuntimeError("the program exited") from None
        message = self._message()
        self.broken = False
        if message[0] == "raise" and len(message) == 5:
            name, base, said, own = message[1:]
            key = own if type(own) is int else (str(name), str(base))
            raise _exception_class(str(name), str(base), self.exceptions, key)(str(said))
        if message[0] != "ok" or len(message) < 2:
            self.broken = True
            raise ProgramBroken("the program did not answer the question")
        return message

    def remote(self, ident, kind, name):
        if kind not in ("object", "function", "class", "iterator"):
            raise Malformed("an unknown reference")  # noqa: F821 - values.py's
        return Remote(self, ident, kind, str(name)[:100])

    def value(self, data):
        try:
            return decode(data, self.remote)  # noqa: F821 - values.py's
        except RecursionError:
            raise ValueError("a value nested too deep") from None

    def encode(self, value):
        def ref(v):
            if isinstance(v, Remote) and v._program is self:
                return ["R", v._id, v._kind, v._name]
            raise Unencodable(  # noqa: F821 - values.py's
                f"a {type(v).__name__} of the test cannot be carried to the program")
        try:
            return encode(value, ref)  # noqa: F821 - values.py's
        except RecursionError:
            raise ValueError("an argument nested too deep") from None

    def ask(self, request):
        return self.value(self._exchange(request)[1])

    def next_items(self, ident):
        message = self._exchange(["next", ident, 1024])
        items = self.value(message[1])
        if type(items) is not list or len(message) != 3 or type(message[2]) is not bool:
            raise ProgramBroken("the program did not answer the question")
        return items, message[2]

    def call(self, ident, args, kwargs):
        message = self._exchange(["call", ident, [self.encode(a) for a in args],
                                  {str(k): self.encode(v) for k, v in kwargs.items()}])
        result = self.value(message[1])
        changed = message[2] if len(message) == 3 and type(message[2]) is list else []
        for item in changed:  # what the call changed of the arguments the test holds
            if type(item) is list and len(item) == 2:
                key = item[0]
                target = (args[key] if type(key) is int and 0 <= key < len(args)
                          else kwargs.get(key) if type(key) is str else None)
                write_back(target, self.value(item[1]))
        return result

    def function(self, name):
        kind = self.names.get(name)
        if not (isinstance(kind, list) and len(kind) >= 2 and type(kind[1]) is int):
            raise RuntimeError(f"the program has no function {name}")
        return Remote(self, kind[1], "class" if kind[0] == "class" else "function", name)

    def close(self):
        end_process(self.proc)  # noqa: F821 - included
        self.results.close()
        if not self.checked:
            self.jail.check(self.proc, killed=True)


def write_back(target, new):
    """The test's own mutable argument given the state the call left it in."""
    if isinstance(target, (list, bytearray)) and isinstance(new, type(target)):
        target[:] = new
    elif isinstance(target, dict) and isinstance(new, dict):
        target.clear()
        target.update(new)
    elif isinstance(target, set) and isinstance(new, (set, frozenset)):
        target.clear()
        target.update(new)
    elif isinstance(target, collections.deque) and isinstance(new, collections.deque):
        target.clear()
        target.extend(new)


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def program_names(program, test_source, taken):
    """The program's top-level names that the test code uses, as the test code's namespace
    gets them: functions and classes through the pipe (an exception class as a trusted
    class of its built-in base), modules imported here, constants rebuilt. Never a
    builtin's name or one the setup or the harness already binds."""
    bound = {}
    for name, kind in program.names.items():
        if (not isinstance(name, str) or not _IDENT.match(name) or name in taken
                or hasattr(builtins, name) or not re.search(rf"\b{name}\b", test_source)
                or not isinstance(kind, list) or not kind or not isinstance(kind[0], str)):
            continue
        try:
            if kind[0] == "function" or (kind[0] == "class" and len(kind) == 3
                                         and kind[2] is None):
                bound[name] = program.function(name)
            elif kind[0] == "class" and isinstance(kind[2], str) and type(kind[1]) is int:
                bound[name] = _exception_class(name, kind[2], program.exceptions, kind[1])
            elif kind[0] == "module" and len(kind) == 2 and kind[1] in PURE_MODULES:
                bound[name] = importlib.import_module(kind[1])
            elif kind[0] == "value" and len(kind) == 2:
                bound[name] = program.value(kind[1])
        except Exception:  # noqa: BLE001 - a name the test code cannot use is left out
            continue
    return bound


def _text(error):
    """An exception's message, whatever its ``__str__`` does (the program may have made it)."""
    try:
        return str(error)[:200]
    except BaseException:  # noqa: BLE001
        return "(no message)"


def run_calls(jail, where, spec, time_s, wall_s, memory_mb):
    """Per case, the test code (trusted) runs here, with the program behind a pipe. The
    cases of a problem share one program, as their datasets' own harnesses run them in one
    process; a program that broke (died, timed out, answered out of turn) is started again
    for the next case."""
    results = []
    entry = spec["entry_point"]
    setup = spec.get("setup", "")
    program = None
    for code in spec["cases"]:
        try:
            if program is None:
                program = jail.retrying(lambda: Program(jail, where, entry, time_s, wall_s,
                                                        memory_mb))
            # The program's names first, so that the setup can use them (MBPP's 367 builds
            # its trees of the program's Node); then the setup, whose own definitions win
            # over the program's (HumanEval's helpers are the task's).
            ns = {"__name__": "__tests__"}
            ns.update(program_names(program, setup + "\n" + code, {entry, "candidate"}))
            exec(compile(setup, "setup", "exec"), ns)
            candidate = program.function(entry)
            ns.update({"candidate": candidate, entry: candidate})
            exec(compile(code, "tests", "exec"), ns)
            # HumanEval's test code defines check(candidate) without calling it (a program's
            # own function named check, MBPP's 56, is the one the asserts call).
            if re.search(r"^def check\(", code, re.M) and not re.search(r"^check\(", code,
                                                                          re.M):
                ns["check"](candidate)
            results.append((True, "ok"))
        except JailError:  # noqa: F821 - from jail.py
            raise
        except AssertionError:
            results.append((False, "assertion failed"))
        except TimeoutError as e:
            results.append((False, str(e) or "time limit"))
        except BaseException as e:  # noqa: BLE001 - whatever the program causes fails the test
            results.append((False, f"{type(e).__name__}: {_text(e)}"))
        finally:
            if program is not None and (program.broken or program.proc.poll() is not None):
                program.close()
                program = None
                kill_others()
    if program is not None:
        program.close()
        kill_others()
    return results


INT_DIGITS = 100_000  # what a test may turn into text of an int (Python's default: 4,300)


def grade(spec, where, base_kb):
    """The verdict's fields for the program in ``where`` against ``spec``'s tests."""
    time_s, memory_mb = spec.get("time_s", 5.0), spec.get("memory_mb", 512)
    wall_s = spec.get("wall_s", WALL_FACTOR * time_s)
    # Jail is from jail.py, included when the harness is shipped.
    # noexec_binds: a program is Python, nothing it writes is executed.
    jail = Jail(shm_mb=int(spec.get("shm_mb", 64)), enabled=spec.get("jail", True),  # noqa: F821
                noexec_binds=True, disk_mb=spec.get("disk_mb"),
                probe=not spec.get("jail_seen", False))
    try:
        if spec["style"] == "stdio":
            results = []
            checker = spec.get("checker") or {"kind": "tokens"}
            for test in spec["tests"]:
                results.append(jail.retrying(lambda t=test: run_stdio(
                    jail, where, t, time_s, wall_s, memory_mb, checker)))
                kill_others()
        else:
            results = run_calls(jail, where, spec, time_s, wall_s, memory_mb)
    except (JailError, CheckerError) as e:  # noqa: F821 - not the program's fault: an error
        return {"error": str(e)}
    finally:
        LITERALS.close()
    peak_kb = peak_rss_kb()
    return {"passed": sum(1 for ok, _ in results if ok), "total": len(results),
            "jail": jail.name, "results": [{"ok": ok, "why": why} for ok, why in results],
            "memory_mb": {"start": round(base_kb / 1024, 1), "peak": round(peak_kb / 1024, 1)}}


def program_dir(program):
    """The program's own directory: a private copy, so that the jail binds it alone."""
    where = tempfile.mkdtemp(prefix="candidate-")
    with open(os.path.join(where, SOLUTION), "wb") as f:
        f.write(program if isinstance(program, bytes)
                else program.encode("utf-8", errors="surrogatepass"))
    os.chmod(where, 0o755)
    return where


def main():
    harden()
    # A test reads big results as text (len(str(f(n)))), but converting is quadratic: a
    # program's 10-million-digit result must not hold the grading for minutes.
    sys.set_int_max_str_digits(INT_DIGITS)
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
        return
    base_kb = peak_rss_kb()
    spec = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # nothing of the tests is left to read on fd 0
    with open(SOLUTION, "rb") as f:
        where = program_dir(f.read())
    verdict(spec["nonce"], **grade(spec, where, base_kb))


# -- the warm grader ---------------------------------------------------------------------
#
# ``python3 -I -S code_harness.py --serve SOCKET``: a grading sandbox that serves problem
# after problem (the EVAL pool's warm graders, prorl_farm/sandbox/warm_graders.py), each as
# the one-shot harness grades one, without the sandbox's start and this process's. A
# connection to SOCKET (in the sandbox's workspace, which no jail sees) brings one problem:
# its spec as above with the ``program``, length-prefixed (8 bytes, little-endian); a
# process forked from this one, which has run nothing of any task, grades it (the program in
# a fresh jail, the test code in this fork alone) and writes the nonce-tagged verdict line
# back. Its client gone, it ends at once, with everything it started. One problem at a
# time: after each, whatever is left of it is killed and its scratch in /tmp removed.

SPEC_BYTES = 1 << 30  # a problem's spec, at most
HELPERS_DIR = None  # a warm grader's jail helpers, compiled (read-only in each jail)


def compiled_helpers():
    """The call server and the stdio runner as modules with their bytecode cached beside
    them, in a directory of their own that each jail binds read-only: a program's start
    imports them instead of compiling their text (a tenth of a start)."""
    import py_compile

    where = tempfile.mkdtemp(prefix="jail-helpers-")
    for name, text in (("prorl_call_server", CALL_SERVER),  # noqa: F821
                       ("prorl_confine", CONFINE_SOURCE)):  # noqa: F821
        path = os.path.join(where, name + ".py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        py_compile.compile(path, doraise=True)
    for root, dirs, files in os.walk(where):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    os.chmod(where, 0o755)
    return where


def serve(path):
    global HELPERS_DIR
    SERVER.add(os.getpid())
    HELPERS_DIR = compiled_helpers()
    for name in ("base64", "decimal", "fractions"):  # what a grading would import: once here
        importlib.import_module(name)
    if not Jail().works:  # noqa: F821 - from jail.py: probed here, once
        sys.stderr.write("no jail here: a warm grader serves jailed programs only\n")
        sys.exit(3)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".new")
    os.chmod(path + ".new", 0o600)
    server.listen(8)
    os.rename(path + ".new", path)  # there, it is served
    scratch = tempfile.gettempdir()
    _reap_all()  # what the probe's jail left to us, the subreaper
    while True:
        conn, _ = server.accept()
        before = set(os.listdir(scratch))
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                server.close()
                status = serve_one(conn)
            finally:
                os._exit(status)
        conn.close()
        os.waitpid(pid, 0)
        kill_others()
        _reap_all()
        for name in set(os.listdir(scratch)) - before:
            shutil.rmtree(os.path.join(scratch, name), ignore_errors=True)


def _reap_all():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def serve_one(conn):
    harden()  # this process's own: a subreaper is not one for its forks
    conn.settimeout(60)
    head = _received(conn, 8)
    size = struct.unpack("<Q", head)[0] if len(head) == 8 else SPEC_BYTES + 1
    if size > SPEC_BYTES:
        return 2
    spec = json.loads(_received(conn, size))
    conn.settimeout(None)
    where = program_dir(spec.pop("program"))
    threading.Thread(target=_end_with_client, args=(conn,), daemon=True).start()
    fields = grade(spec, where, peak_rss_kb())
    conn.sendall(("\n" + spec["nonce"] + " " + json.dumps(fields) + "\n").encode())
    conn.close()
    kill_others()
    return 0


def _received(conn, n):
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _end_with_client(conn):
    """A grading whose client hung up (the job cancelled, its deadline passed) ends now."""
    poll = select.poll()
    poll.register(conn, select.POLLRDHUP)
    while not poll.poll():
        pass
    kill_others(within_s=5.0)
    os._exit(1)


def peak_rss_kb():
    """This process's peak resident memory since it started (``VmHWM``: unlike
    ``ru_maxrss``, not the forking parent's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def verdict(nonce, **fields):
    sys.stdout.write("\n" + nonce + " " + json.dumps(fields) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
