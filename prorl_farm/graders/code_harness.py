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
  that answers calls over a pipe, arguments and results as Python literals only. The test
  code (trusted) runs here, with ``candidate`` and the entry point bound to that pipe, and,
  as HumanEval's and MBPP's own harnesses give them, the program's top-level names the test
  code uses: its functions (called through the same pipe), the modules it imported
  (imported here by name) and its literal constants. The test setup's own definitions and
  Python's builtins are never replaced by the program's. A returned object with a rigged
  ``__eq__``, a patched ``assert``/``unittest``/``pytest``, an early ``os._exit(0)`` or
  printed fake results cannot pass a test. Of the modules a program imported, only those
  whose import does nothing but define names (``PURE_MODULES``) are imported here: a name
  bound to ``unittest.__main__`` (which exits when imported) is left out. Whatever the
  program makes this process raise (``SystemExit`` and every other ``BaseException``
  included) fails that test with the reason: a wrong program earns 0, never an error.
  What the program writes is read as Python literals by a child process of bounded memory
  (``Literals``): ``ast.literal_eval`` can take hundreds of times the size of its input,
  here it costs this process only the value (a line is at most ``MAX_LINE``).

After each test every other process of the sandbox's user is killed and reaped (this process
is their subreaper) before the next starts: the process cap counts a task until it is reaped,
so a fork bomb torn down slowly would otherwise leave the next test no process to start.
Exit status 0 and
one line ``NONCE {"passed", "total", "jail", "results": [{"ok", "why"}]}``.
"""

import ast
import builtins
import ctypes
import importlib
import json
import marshal
import os
import re
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
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
    "random", "re", "statistics", "string", "struct", "textwrap", "typing", "unicodedata",
    "zlib"})


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


def kill_others(within_s=30.0):
    """Every process but this one, its literal reader and the sandbox's init: what a test
    left behind, killed, and waited for until it is reaped (until then the process cap
    still counts it), at most ``within_s``. The zombies of the sandbox's init (its shell,
    killed here too) are its own to reap, not waited for. Only inside a sandbox (never as
    root, where "every process" would be the host's)."""
    if os.getuid() == 0:
        return
    keep = {os.getpid(), 1, LITERALS.pid}
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
            if state == b"Z" and ppid == b"1":
                continue
            left = True
            try:
                os.waitpid(pid, os.WNOHANG)  # ours to reap: a child, or an orphan we adopted
            except ChildProcessError:
                pass
        if not left or time.monotonic() > end:
            return
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


# include: jail.py


# The literal reader: reads a length-prefixed text, answers ``o`` + marshal of its value,
# ``m`` (over its memory bound) or ``e`` + the error's name, length-prefixed.
PARSER = r'''
import ast, ctypes, marshal, struct, sys
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(8)
    if len(head) < 8:
        break
    data = inp.read(struct.unpack("<Q", head)[0])
    try:
        blob = b"o" + marshal.dumps(ast.literal_eval(data.decode("utf-8", "replace")))
    except MemoryError:
        blob = b"m"
    except BaseException as e:
        blob = b"e" + type(e).__name__.encode()
    data = None
    out.write(struct.pack("<Q", len(blob)) + blob)
    out.flush()
'''


class Literals:
    """Python literals read in a child process of bounded memory (``PARSER_MB``), started
    on first use and again if it dies; ``read(text)`` returns the value or raises
    ``ValueError`` with the reason."""

    def __init__(self, memory_mb=PARSER_MB):
        self.memory_mb = memory_mb
        self.proc = None

    def read(self, text):
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
        if blob[:1] == b"o":
            return marshal.loads(blob[1:])
        if blob[:1] == b"e":
            raise ValueError(f"not a Python literal ({blob[1:].decode(errors='replace')})")
        self.close()
        raise ValueError("a value too large to read within its memory bound")

    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None

    def close(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            self.proc = None


LITERALS = Literals()


def binds(where):
    """The jail's view for the program, as ``(binds, cwd)``: its directory (a private copy
    of the program, and nothing else), read-only; it writes to its own fresh ``/tmp``."""
    return [(where, False)], where


def normalise(text):
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def run_stdio(jail, where, test, time_s, wall_s, memory_mb):
    """One test: the program with the test's input on its stdin; its output read here up to
    a bound (four times the expected output, at least 1 MiB): a program that floods its
    stdout is stopped, not buffered."""
    bound = max(1 << 20, 4 * len(test["output"].encode()))
    proc = jail.popen([sys.executable, "-I", SOLUTION], *binds(where),
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                      close_fds=True, preexec_fn=limits(memory_mb), env=CHILD_ENV)
    why = "not run"
    try:
        out, why = collect(proc, test["input"].encode(), bound, Clock(proc.pid, time_s, wall_s))
        if jail.filled(proc):
            why = "disk limit"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        proc.stdout.close()
        jail.check(proc, killed=why is not None)
    if why is not None:
        return False, why
    if proc.returncode != 0:
        return False, f"exit status {proc.returncode}"
    ok = normalise(out.decode("utf-8", errors="replace")) == normalise(test["output"])
    return ok, "ok" if ok else "wrong output"


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


# The server in the jail: loads the program, says what its top-level names are, then answers
# calls ``(name, args, kwargs)`` with ``repr(result)`` (literals only) or ``!ErrorName``.
CALL_SERVER = r'''
import ast, os, sys, types
out = os.fdopen(int(sys.argv[2]), "w")
ns = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
    ns[sys.argv[1]]
except BaseException as e:
    out.write("!" + type(e).__name__ + "\n"); out.flush(); raise SystemExit(1)
names = {}
for k, v in list(ns.items()):
    if k.startswith("__"):
        continue
    if isinstance(v, types.ModuleType):
        names[k] = ["module", getattr(v, "__name__", "")]
    elif callable(v):
        names[k] = ["callable"]
    else:
        try:
            text = repr(v)
            ast.literal_eval(text)
            names[k] = ["value", text]
        except BaseException:
            pass
out.write("ready " + repr(names).replace("\n", " ") + "\n"); out.flush()
for line in sys.stdin:
    try:
        name, args, kwargs = ast.literal_eval(line)
        value = ns[name](*args, **kwargs)
        text = repr(value)
        ast.literal_eval(text)
        out.write(text.replace("\n", " ") + "\n")
    except BaseException as e:
        out.write("!" + type(e).__name__ + "\n")
    out.flush()
'''


class Program:
    """The program, loaded in the jail; its functions are called through a pipe."""

    def __init__(self, jail, where, entry_point, time_s, wall_s, memory_mb):
        self.time_s, self.wall_s = time_s, wall_s
        r, w = os.pipe()
        self.jail = jail
        self.proc = jail.popen(
            [sys.executable, "-I", "-c", CALL_SERVER, entry_point, str(w)], *binds(where),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(w,), close_fds=True, preexec_fn=limits(memory_mb), env=CHILD_ENV)
        os.close(w)
        self.results = os.fdopen(r, "rb")
        self.checked = False
        try:
            first = self._read()
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
            if not first.startswith("ready "):
                raise RuntimeError(f"the program did not load ({first.lstrip('!')[:200]})")
            try:
                self.names = LITERALS.read(first[len("ready "):])
            except ValueError as e:
                raise RuntimeError(f"the program did not load (bad name table: {e})") \
                    from None
            if not isinstance(self.names, dict):
                raise RuntimeError("the program did not load (bad name table)")
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

    def call(self, name, args, kwargs):
        text = repr((name, tuple(args), dict(kwargs)))
        ast.literal_eval(text)  # only literals cross
        self.proc.stdin.write((text.replace("\n", " ") + "\n").encode())
        self.proc.stdin.flush()
        line = self._read()
        if line.startswith("!"):
            raise RuntimeError(f"the program raised {line[1:200]}")
        return LITERALS.read(line)

    def function(self, name):
        def call(*args, **kwargs):
            return self.call(name, args, kwargs)
        call.__name__ = name
        return call

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.results.close()
        if not self.checked:
            self.jail.check(self.proc, killed=True)


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def program_names(program, test_source, taken):
    """The program's top-level names that the test code uses, as the test code's namespace
    gets them: functions through the pipe, modules imported here, literal constants. Never a
    builtin's name or one the setup or the harness already binds."""
    bound = {}
    for name, kind in program.names.items():
        if (not isinstance(name, str) or not _IDENT.match(name) or name in taken
                or hasattr(builtins, name) or not re.search(rf"\b{name}\b", test_source)
                or not isinstance(kind, (list, tuple)) or not kind
                or not all(isinstance(k, str) for k in kind)):
            continue
        try:
            if kind[0] == "callable":
                bound[name] = program.function(name)
            elif kind[0] == "module" and len(kind) == 2 and kind[1] in PURE_MODULES:
                bound[name] = importlib.import_module(kind[1])
            elif kind[0] == "value" and len(kind) == 2:
                bound[name] = LITERALS.read(kind[1])
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
    """Per case: the test code (trusted) runs here, with the program behind a pipe."""
    results = []
    entry = spec["entry_point"]
    setup = spec.get("setup", "")
    for code in spec["cases"]:
        program = None
        try:
            program = jail.retrying(lambda: Program(jail, where, entry, time_s, wall_s,
                                                           memory_mb))
            ns = {"__name__": "__tests__"}
            exec(compile(setup, "setup", "exec"), ns)
            candidate = program.function(entry)
            ns.update(program_names(program, setup + "\n" + code, set(ns) | {entry,
                                                                               "candidate"}))
            ns.update({"candidate": candidate, entry: candidate})
            exec(compile(code, "tests", "exec"), ns)
            # HumanEval's test code defines check(candidate) without calling it.
            if callable(ns.get("check")) and not re.search(r"^check\(", code, re.M):
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
            if program is not None:
                program.close()
            kill_others()
    return results


def main():
    harden()
    base_kb = peak_rss_kb()
    spec = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # nothing of the tests is left to read on fd 0
    nonce = spec["nonce"]
    time_s, memory_mb = spec.get("time_s", 5.0), spec.get("memory_mb", 512)
    wall_s = spec.get("wall_s", WALL_FACTOR * time_s)
    # Jail is from jail.py, included when the harness is shipped.
    # noexec_binds: a program is Python, nothing it writes is executed.
    jail = Jail(shm_mb=int(spec.get("shm_mb", 64)), enabled=spec.get("jail", True),  # noqa: F821
                noexec_binds=True, disk_mb=spec.get("disk_mb"))
    # The program's own directory: a private copy, so the jail binds it alone.
    where = tempfile.mkdtemp(prefix="candidate-")
    shutil.copy(SOLUTION, os.path.join(where, SOLUTION))
    os.chmod(where, 0o755)
    try:
        if spec["style"] == "stdio":
            results = []
            for test in spec["tests"]:
                results.append(jail.retrying(lambda t=test: run_stdio(jail, where, t, time_s,
                                                                      wall_s, memory_mb)))
                kill_others()
        else:
            results = run_calls(jail, where, spec, time_s, wall_s, memory_mb)
    except JailError as e:  # noqa: F821 - the environment's fault: an error, not a zero
        verdict(nonce, error=str(e))
        return
    finally:
        LITERALS.close()
    peak_kb = peak_rss_kb()
    verdict(nonce, passed=sum(1 for ok, _ in results if ok), total=len(results),
            jail=jail.name, results=[{"ok": ok, "why": why} for ok, why in results],
            memory_mb={"start": round(base_kb / 1024, 1), "peak": round(peak_kb / 1024, 1)})


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
