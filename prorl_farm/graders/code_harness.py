"""Grade a submitted program against hidden tests; the verdict is this process's last line.

Run as ``python3 -I -S code_harness.py`` in a fresh sandbox holding ``solution.py``,
``tests.json`` and this file. The submitted program never runs in this process:

- stdio tests: each test runs ``python3 -I solution.py`` with the input on stdin, under time,
  memory and file-size limits; this process compares the output it captured.
- call tests (HumanEval/MBPP style): the program is loaded in a child that answers calls of
  its entry point over a pipe, arguments and results as Python literals only; the tests'
  own code (asserts) runs here, calling the entry point through that pipe. A returned object
  with a rigged ``__eq__``, a patched ``assert``/``unittest``/``pytest``, an early
  ``os._exit(0)`` or printed fake results cannot pass a test.

This process is not dumpable (no ptrace, no reading its fds or memory), and after each test
every other process of the sandbox's user is killed. Exit status 0 and one JSON line:
``{"passed", "total", "results": [{"ok", "why"}]}``.
"""

import ast
import ctypes
import json
import os
import re
import resource
import select
import signal
import subprocess
import sys
import time

PR_SET_DUMPABLE = 4
SOLUTION = "solution.py"


def harden():
    try:
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
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


def kill_others():
    """Every process but this one and the sandbox's init: what a test left behind. Only
    inside a sandbox (never as root, where "every process" would be the host's)."""
    if os.getuid() == 0:
        return
    me = os.getpid()
    for _ in range(3):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in (me, 1):
                continue
            try:
                os.kill(int(name), signal.SIGKILL)
                found = True
            except (ProcessLookupError, PermissionError):
                pass
        if not found:
            return
        time.sleep(0.01)


def normalise(text):
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def run_stdio(test, time_s, memory_mb):
    try:
        proc = subprocess.run([sys.executable, "-I", SOLUTION], input=test["input"].encode(),
                              capture_output=True, timeout=time_s, close_fds=True,
                              preexec_fn=limits(memory_mb), env={"PATH": "/usr/bin:/bin",
                                                                 "LANG": "C.UTF-8"})
    except subprocess.TimeoutExpired:
        return False, "time limit"
    if proc.returncode != 0:
        return False, f"exit status {proc.returncode}"
    ok = normalise(proc.stdout.decode("utf-8", errors="replace")) == normalise(test["output"])
    return ok, "ok" if ok else "wrong output"


CALL_SERVER = r'''
import ast, os, sys
out = os.fdopen(int(sys.argv[2]), "w")
ns = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), ns)
    fn = ns[sys.argv[1]]
except BaseException as e:
    out.write("!" + repr(type(e).__name__) + "\n"); out.flush(); raise SystemExit(1)
out.write("ready\n"); out.flush()
for line in sys.stdin:
    try:
        args = ast.literal_eval(line)
        value = fn(*args)
        text = repr(value)
        ast.literal_eval(text)
        out.write(text.replace("\n", " ") + "\n")
    except BaseException as e:
        out.write("!" + repr(type(e).__name__) + "\n")
    out.flush()
'''


class Candidate:
    """The entry point, called through a pipe to the child running the program."""

    def __init__(self, entry_point, time_s, memory_mb):
        self.time_s = time_s
        r, w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", CALL_SERVER, entry_point, str(w)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(w,), close_fds=True, preexec_fn=limits(memory_mb),
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        os.close(w)
        self.results = os.fdopen(r, "r")
        first = self._read()
        if first != "ready":
            raise RuntimeError(f"the program did not load ({first})")

    def _read(self):
        ready, _, _ = select.select([self.results], [], [], self.time_s)
        if not ready:
            raise TimeoutError("time limit")
        line = self.results.readline()
        if not line:
            raise RuntimeError("the program exited")
        return line.rstrip("\n")

    def __call__(self, *args):
        text = repr(tuple(args))
        ast.literal_eval(text)  # only literals cross
        self.proc.stdin.write((text.replace("\n", " ") + "\n").encode())
        self.proc.stdin.flush()
        line = self._read()
        if line.startswith("!"):
            raise RuntimeError(f"the program raised {line[1:]}")
        return ast.literal_eval(line)

    def close(self):
        try:
            self.proc.kill()
        except OSError:
            pass


def run_calls(tests, time_s, memory_mb):
    """One test: the test code (trusted) runs here with ``candidate`` bound to the pipe."""
    results = []
    for code in tests["cases"]:
        cand = None
        try:
            cand = Candidate(tests["entry_point"], time_s, memory_mb)
            ns = {"candidate": cand, tests["entry_point"]: cand, "__name__": "__tests__"}
            exec(compile(tests.get("setup", "") + "\n" + code, "tests", "exec"), ns)
            # HumanEval's test code defines check(candidate) without calling it.
            if callable(ns.get("check")) and not re.search(r"^check\(", code, re.M):
                ns["check"](cand)
            results.append((True, "ok"))
        except AssertionError:
            results.append((False, "assertion failed"))
        except TimeoutError:
            results.append((False, "time limit"))
        except Exception as e:  # noqa: BLE001 - any failure fails the test
            results.append((False, f"{type(e).__name__}: {str(e)[:200]}"))
        finally:
            if cand is not None:
                cand.close()
            kill_others()
    return results


def main():
    harden()
    with open("tests.json") as f:
        spec = json.load(f)
    time_s, memory_mb = spec.get("time_s", 5.0), spec.get("memory_mb", 512)
    if spec["style"] == "stdio":
        results = []
        for test in spec["tests"]:
            results.append(run_stdio(test, time_s, memory_mb))
            kill_others()
    else:
        results = run_calls(spec, time_s, memory_mb)
    passed = sum(1 for ok, _ in results if ok)
    sys.stdout.write(json.dumps({"passed": passed, "total": len(results),
                                 "results": [{"ok": ok, "why": why} for ok, why in results]})
                     + "\n")


if __name__ == "__main__":
    main()
