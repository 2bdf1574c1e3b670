"""Run a repository task's named tests and decide each one's outcome from evidence the code
under test cannot forge; the verdict is one line tagged with a nonce only this process knows.

Run as ``python3 -I grader/swe_harness.py`` in a fresh sandbox holding ``repo/`` (the tree
to test: the base commit with the candidate's changes, protected files already restored
from the base) and ``grader/`` (``spec.json``, ``test.patch``, ``swe_runner.py``, and
``model.patch`` in reference mode). The nonce comes on stdin.

This process reads all of ``grader/`` into memory and removes it before anything of the
repository runs, is not dumpable, and never imports the repository. In order: ask the
grading pytest which files it reads as configuration (protected too); apply ``model.patch``
(not applying: the candidate fails); run the instance's setup commands in the jail (the
repository is what they see); put every protected file back as it was at the base and
remove any new one (the setup ran the candidate's code); apply the test patch (not
applying: an instance error); then run the tests in a child, ``swe_runner.py``, in the jail:
the repository's code runs there and only there. The child sends evidence over a pipe, each
record prefixed with a key it got on its stdin; this process decides:

- a test passed only if pytest reported its setup, call and teardown without failure *and*
  the child's own wrapper saw its call return;
- a ``suspicious`` record (the child's audit hook or integrity checks caught the candidate's
  code reaching into the test process), or any line on the pipe without the key, makes
  the whole verdict ``suspicious``;
- a test with no records (the child died, exited early, or ran out of time) is ``missing``;
- a second witness: pytest's own report of the run (its ``-rA`` summary, read from the
  run's output line by line as SWE-bench's log parser reads a log) must agree: a test the
  records say passed counts only if the report says so too (else ``missing``), and a report
  that contradicts the records (passed where they say otherwise, or another status where
  they say passed) makes the verdict ``suspicious``.

The verdict: ``NONCE {"outcomes": {test: outcome}, "suspicious": null | why, "jail",
"exit_code", "output"}``, or ``NONCE {"error": ...}`` when the instance or the environment
is at fault, or ``NONCE {"applied": false, ...}`` when the candidate patch does not apply.
"""

import ctypes
import hashlib
import json
import os
import re
import secrets
import select
import shutil
import subprocess
import sys
import time

PR_SET_DUMPABLE = 4
OUTPUT_TAIL = 4000
MAX_RECORD = 1 << 20
# What SWE-bench's pytest log parser reads: a line that starts with a status word names a
# test (its next word) and says its status; a later line for a name overwrites an earlier.
STATUS_WORDS = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")
MAX_WITNESS = 200_000  # names kept from the report
MAX_LINE = 1 << 16  # a longer line names no test
STATUS_WORDS_B = tuple(w.encode() for w in STATUS_WORDS)
# The report's words for each outcome the records call a pass (a non-strict unexpected pass
# is XPASS in the report where the records do not tell expected failures apart).
PASS_WORDS = {"passed": ("PASSED", "XPASS"), "xfail": ("XFAIL",), "xpass": ("XPASS",)}
# A repository's own runner: its log names a pass PASSED, and no other outcome a pass.
RUNNER_PASS_WORDS = {"passed": ("PASSED",)}
OUTCOMES = ("passed", "failed", "error", "skipped", "xfail", "xpass")
RUNNER_NAMES = {"pytest": "pytest", "django": "Django's runtests.py", "sympy": "sympy's bin/test"}
# A failure's header in bin/test's log (swebench's ``parse_log_sympy`` pattern).
SYMPY_HEADER = re.compile(r"(_*) (.*)\.py:(.*) (_*)")
report_state = {}  # Django's log: the test the last `` ... `` line began


# include: jail.py
# include: ending.py


def main():
    nonce = sys.stdin.readline().strip()
    started = time.monotonic()
    try:
        ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, no /proc/self/mem
    except (OSError, AttributeError):
        pass
    # The tree under test and the grader's files: ``repo/`` and ``grader/``, or where the
    # command line says (a SWE-bench environment has its checkout at the workspace itself).
    repo = os.path.abspath(sys.argv[1] if len(sys.argv) > 2 else "repo")
    kept = read_grader(os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else "grader"))
    spec = json.loads(kept["spec.json"])

    def verdict(**fields):
        sys.stdout.write(f"\n{nonce} {json.dumps(fields)}\n")
        sys.stdout.flush()
        os._exit(0)

    jail = Jail(shm_mb=int(spec.get("shm_mb", 64)), enabled=spec.get("jail", True),  # noqa: F821 - from jail.py
                noexec_binds=spec.get("noexec", False), disk_mb=spec.get("disk_mb"))
    kind = spec.get("kind", "pytest")
    configs = pytest_configs(jail, repo, verdict) if kind == "pytest" else []
    spec["protected_names"] = sorted(set(spec.get("protected_names", [])) | set(configs))
    discarded = prepare_tree(jail, repo, spec, kept, verdict)
    trust_test_files(repo, spec)
    wanted = list(dict.fromkeys(spec["tests"]))
    key = secrets.token_hex(24)
    deadline = started + max(5.0, float(spec.get("timeout_s", 900)) - 5.0)
    runner = kept["swe_runner.py"].decode()
    try:
        records, suspicious, code, output, late, report, filled = jail.retrying(
            lambda: run_tests(jail, repo, runner, spec, wanted, key, deadline))
    except JailError as e:  # noqa: F821 - from jail.py
        verdict(error=str(e))
    if spec.get("every_test"):  # every test the run reported, in run order
        collected = next((r["tests"] for r in records if r.get("kind") == "collected"), [])
        reported = [r["test"] for r in records if r.get("kind") in ("report", "result")]
        wanted = list(dict.fromkeys([*collected, *reported, *wanted]))
    first = decide(wanted, records, spec.get("every_test", False))
    outcomes, contradicted = witnessed(first, report, kind)
    if contradicted and not suspicious:
        suspicious = (f"{RUNNER_NAMES.get(kind, kind)}'s own report of the run (its log, read "
                      "as SWE-bench reads it) disagrees with the runner's records on "
                      + ", ".join(f"{t} ({said})" for t, said in contradicted[:3]))
    unwitnessed = [t for t, o in outcomes.items() if o == "missing" and o != first[t]]
    verdict(outcomes=outcomes, suspicious=suspicious, jail=jail.name, exit_code=code,
            timed_out=late, disk_full=filled, output=output, discarded=discarded,
            unwitnessed=unwitnessed[:20])


def read_grader(grader):
    """The grader's files, read into memory; the directory removed (nothing of the grader
    left on disk)."""
    kept = {}
    for name in ("spec.json", "test.patch", "model.patch", "swe_runner.py"):
        path = os.path.join(grader, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                kept[name] = f.read()
    shutil.rmtree(grader, ignore_errors=True)
    return kept


def pytest_configs(jail, repo, verdict):
    """The files the grading pytest reads as configuration: from its own source, not a list
    (pytest 9 reads pytest.toml and .pytest.toml too). Probed before anything of the
    candidate's is in the tree. (Django's and sympy's runners read no such file: theirs
    are in the spec's protected paths.)"""
    names = ("import json, inspect, re, pytest, _pytest.config.findpaths as f; "
             "print(json.dumps(sorted(set(re.findall(r'[\"\\']([\\w.-]+\\.(?:toml|ini|cfg))"
             "[\"\\']', inspect.getsource(f))))))")
    try:
        probe = jail.retrying(lambda: jail.run([sys.executable, "-I", "-c", names],
                                               [(repo, True)], repo))
    except JailError as e:  # noqa: F821 - from jail.py
        verdict(error=str(e))
    if probe.returncode != 0:
        verdict(error=f"pytest is not importable by {sys.executable} in the sandbox: "
                      f"{probe.stderr[-1000:]}")
    try:
        return json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return []


def apply_patch(repo, patch):
    out = subprocess.run(["git", "apply", "--whitespace=nowarn", "-p1", "-"], cwd=repo,
                         capture_output=True, input=patch)
    return out.returncode == 0, (out.stdout + out.stderr).decode(errors="replace")[-2000:]


def prepare_tree(jail, repo, spec, kept, verdict):
    """The tree as its tests must find it: the reference patch applied (if one came), the
    setup commands run in the jail, every protected file put back, the test patch applied.
    Returns the protected paths whose changes were undone.

    What the protected files must hold when the tests start: as at the base (a reference
    patch: read here before it is applied; a policy's tree: as the farm sent it). Without
    setup commands nothing but the reference patch writes before the tests: only the
    paths it touches are read and put back (the farm wrote a policy's tree with its
    protected files restored), not every file of a tree of thousands."""
    setup = spec.get("setup", [])
    touched = None
    if "model.patch" in kept:
        if not setup:
            touched = touched_by(kept["model.patch"], repo)
        before = protected_files(repo, spec, touched)
        ok, why = apply_patch(repo, kept["model.patch"])
        if not ok:
            verdict(applied=False, why=why)
    else:
        before = {path: text.encode("latin-1") for path, text in
                  spec.get("protected_base", {}).items()}
        if not setup:
            touched = []
    for command in setup:
        try:
            out = jail.retrying(lambda c=command: jail.run(
                ["bash", "--noprofile", "--norc", "-c", c], [(repo, True)], repo))
        except JailError as e:  # noqa: F821 - from jail.py
            verdict(error=str(e))
        if out.returncode != 0:
            verdict(error=f"setup command failed ({out.returncode}): {command}\n"
                          f"{(out.stdout + out.stderr)[-2000:]}")
    # After the last command that could write (the setup's build runs the candidate's
    # setup.py): every protected file back as it was, any new one gone.
    discarded = restore(repo, spec, before, touched) if ("model.patch" in kept or
                                                "protected_base" in spec) else []
    ok, why = apply_patch(repo, kept["test.patch"])
    if not ok:
        verdict(error=f"the test patch does not apply: {why}")
    return discarded


def trust_test_files(repo, spec):
    """The code the run trusts, by content: the base's (the farm hashed it), and the test
    files as this process just wrote them."""
    if "trusted" not in spec:
        return
    for path in spec.get("test_files", []):
        full = os.path.join(repo, path)
        if path.endswith(".py") and os.path.isfile(full) and not os.path.islink(full):
            with open(full, "rb") as f:
                spec["trusted"][path] = hashlib.sha256(f.read()).hexdigest()


def is_protected(path, spec):
    """As the handler's rule: the test patch's files, test configuration, the test runner's
    files (a repository's own runner), site hooks and compiled bytecode are never the
    candidate's."""
    name = os.path.basename(path)
    return (path in spec.get("test_files", []) or name in spec.get("protected_names", [])
            or any(path == p or (p.endswith("/") and path.startswith(p))
                   for p in spec.get("protected_paths", []))
            or name.endswith(tuple(spec.get("protected_suffixes", [])))
            or any(part in spec.get("skip_dirs", []) for part in path.split("/")))


def touched_by(patch, repo):
    """The paths a patch touches as ``git apply`` reads it (renames' both sides); None if
    git cannot read it (then it does not apply either)."""
    out = subprocess.run(["git", "apply", "--numstat", "-z", "-p1", "-"], cwd=repo,
                         input=patch, capture_output=True)
    if out.returncode != 0:
        return None
    paths, fields = set(), out.stdout.decode("utf-8", "surrogateescape").split("\0")
    i = 0
    while i < len(fields):
        entry = fields[i]
        path = entry.split("\t", 2)[2] if entry.count("\t") >= 2 else ""
        if path:
            paths.add(path)
            i += 1
        elif entry:  # a rename or copy: its two names follow
            paths.update(f for f in fields[i + 1:i + 3] if f)
            i += 3
        else:
            i += 1
    return sorted(os.path.normpath(p) for p in paths)


def protected_files(repo, spec, only=None):
    """The protected files of the tree (``only``: among these paths), by content."""
    if only is not None:
        found = {}
        for path in only:
            full = os.path.join(repo, path)
            if is_protected(path, spec) and os.path.isfile(full) and \
                    not os.path.islink(full):
                with open(full, "rb") as f:
                    found[path] = f.read()
        return found
    found = {}
    for root, dirs, names in os.walk(repo):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in names:
            path = os.path.relpath(os.path.join(root, name), repo)
            if is_protected(path, spec) and not os.path.islink(os.path.join(root, name)):
                with open(os.path.join(root, name), "rb") as f:
                    found[path] = f.read()
    return found


def restore(repo, spec, before, only=None):
    """Undo what a candidate patch did to protected files (a reference patch is graded as a
    policy's edits are; ``only``: the paths anything could have written); returns the
    paths whose changes were discarded."""
    after = protected_files(repo, spec, only)
    discarded = []
    paths = set(before) | set(after) if only is None else \
        {p for p in only if is_protected(p, spec)}
    for path in sorted(paths):
        full = os.path.join(repo, path)
        if before.get(path) == after.get(path) and not os.path.islink(full):
            continue
        discarded.append(path)
        if os.path.islink(full) or os.path.isfile(full):
            os.unlink(full)  # a link is replaced, never written through
        if path in before:
            os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
            with open(full, "wb") as f:
                f.write(before[path])
    return discarded


def definitions(repo, spec):
    """What each protected Python file (the test files, conftests) defines, as this process
    reads it right before the tests start: for every function at module level or in a class
    (inside ``if``/``try``/``with`` blocks too, not inside functions), its class path and
    name (``Cls::name``), the lines its code may start at (its ``def``'s, its decorators'),
    and the fixture names its decorators give it (``name=``). The runner holds the tests,
    fixtures and hooks it runs from these files to these definitions."""
    import ast

    found = {}
    for path in sorted(protected_files(repo, spec)):
        if not path.endswith(".py"):
            continue
        try:
            with open(os.path.join(repo, path), "rb") as f:
                tree = ast.parse(f.read(), path)
        except (OSError, SyntaxError, ValueError):
            continue
        defs = found[path] = []

        def walk(body, chain, defs=defs):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = sorted({node.lineno, *(d.lineno for d in node.decorator_list)})
                    names = [getattr(kw.value, "value", getattr(kw.value, "s", None))
                             for d in node.decorator_list if isinstance(d, ast.Call)
                             for kw in d.keywords if kw.arg == "name"]
                    defs.append(["::".join([*chain, node.name]), lines,
                                 [n for n in names if isinstance(n, str)]])
                elif isinstance(node, ast.ClassDef):
                    walk(node.body, [*chain, node.name])
                else:
                    for field in ("body", "orelse", "finalbody", "handlers"):
                        inner = getattr(node, field, None)
                        if isinstance(inner, list):
                            walk(inner, chain)

        walk(tree.body, [])
    return found


def run_tests(jail, repo, runner, spec, wanted, key, deadline):
    """Run the child (``runner``: its source); returns (its records, why it is suspicious or
    None, its exit code or None, the tail of its output, whether it ran out of time,
    pytest's own report, and what it wrote if it was stopped for the disk limit)."""
    kind = spec.get("kind", "pytest")
    r, w = os.pipe()
    # The run's output: read from a pipe, its last ``log_bytes`` kept in memory. Never a
    # file: what the tests print is theirs to size, and a file would count in the
    # workspace's bound, which the candidate's own writes use.
    log_r, log_w = os.pipe()
    request = runner_request(repo, spec, wanted, key, w, kind)
    child = start_runner(jail, repo, runner, request, log_w)
    os.close(w)
    os.close(log_w)
    evidence, log = Evidence(key), RunLog(int(spec.get("log_bytes", OUTPUT_TAIL)), kind)
    late = collect(r, log_r, evidence, log, deadline)
    try:  # the runner ends itself after its last record; past the deadline we end it
        child.wait(timeout=0 if late else 5)
        killed = False
    except subprocess.TimeoutExpired:
        killed = True
    end_process(child)  # noqa: F821 - from ending.py
    filled = jail.filled(child)
    jail.check(child, killed=killed)
    report = log.finish()
    done = next((rec for rec in evidence.records if rec.get("kind") == "done"), None)
    return (evidence.records, evidence.suspicious, done["exit_code"] if done else None,
            log.output(), late, report, filled)


def runner_request(repo, spec, wanted, key, fd, kind):
    """What the runner is told (one JSON line on its stdin): the tests, the files they are
    in, the evidence pipe ``fd`` and its ``key``, and the grader's rules for the run."""
    files = spec.get("files") or [f for f in dict.fromkeys(t.split("::")[0] for t in wanted)
                                  if os.path.isfile(os.path.join(repo, f))]
    return {"key": key, "fd": fd, "repo": repo, "tests": wanted, "files": files,
            "kind": kind, "runner_args": spec.get("runner_args", []),
            "changed": spec.get("changed", []), "test_files": spec.get("test_files", []),
            "every_test": spec.get("every_test", False), "guard": spec.get("guard", True),
            "plugins": spec.get("plugins", []),
            "defs": definitions(repo, spec) if kind == "pytest" else {},
            "pytest_args": with_summary(spec.get("pytest_args", ["-q"])),
            "trusted": spec.get("trusted")}


def start_runner(jail, repo, runner, request, log_w):
    """The runner in the jail, its request written: it keeps the evidence pipe
    (``request["fd"]``), and its output goes to ``log_w``."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    # The runner's code under a name of its own, which no other code may compile under.
    name = f"<prorl-runner-{secrets.token_hex(8)}>"
    request["runner"] = name
    # In a globals dict of its own, with a copy of the builtins: what the runner's code
    # looks names up in is held by no module (``__main__``'s are anyone's to rebind).
    boot = ("import builtins, sys; exec(compile(sys.argv[1], sys.argv[2], 'exec'), "
            "{'__builtins__': dict(vars(builtins)), '__name__': '__prorl_runner__'})")
    child = jail.popen([sys.executable, "-I", "-c", boot, runner, name], [(repo, True)], repo,
                       pass_fds=(request["fd"],), stdin=subprocess.PIPE, stdout=log_w,
                       stderr=log_w, close_fds=True, env=env, start_new_session=True)
    child.stdin.write((json.dumps(request) + "\n").encode())
    child.stdin.close()
    return child


def collect(r, log_r, evidence, log, deadline):
    """Reads the evidence pipe ``r`` and the run's output ``log_r`` until the runner closes
    the former (then what it printed last, for up to 2 s more) or the deadline comes;
    closes both. True: the deadline came with the evidence pipe still open."""
    evidence_open, log_open, drain_until, late = True, True, None, False
    while evidence_open or log_open:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            late = evidence_open
            break
        if not evidence_open:  # the runner is done; what it printed last, briefly
            if drain_until is None:
                drain_until = now + 2.0
            if now >= drain_until:
                break
        ready, _, _ = select.select([f for f, o in ((r, evidence_open), (log_r, log_open))
                                     if o], [], [], min(left, 1.0))
        if log_r in ready:
            log_open = log.feed(os.read(log_r, 65536))
        if r in ready:
            evidence_open = evidence.feed(os.read(r, 65536))
    os.close(r)
    os.close(log_r)
    return late


class Evidence:
    """The runner's records, read from the evidence pipe: a line each, behind the run's key.
    A line without the key, a malformed one or a ``suspicious`` record makes the run
    suspicious (the first reason is kept)."""

    def __init__(self, key):
        self.prefix = (key + " ").encode()
        self.records, self.suspicious, self.buffer = [], None, b""

    def feed(self, chunk):
        """Takes what the pipe gave; False: it is closed."""
        if not chunk:
            return False
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        if len(self.buffer) > MAX_RECORD:
            lines, self.buffer = [*lines, self.buffer], b""
        for line in lines:
            self.line(line)
        return True

    def line(self, line):
        if not line.startswith(self.prefix):
            self.suspect("a record on the evidence pipe without the key")
            return
        try:
            record = json.loads(line[len(self.prefix):])
        except ValueError:
            self.suspect("a malformed record")
            return
        if record.get("kind") == "suspicious":
            self.suspect(f"{record.get('event')}: {record.get('detail')}"
                         + (f" (from {record['where']})" if record.get("where") else ""))
        self.records.append(record)

    def suspect(self, why):
        self.suspicious = self.suspicious or why


class RunLog:
    """The run's output: its last ``keep`` bytes, and pytest's own word on each test read
    from it as it comes."""

    def __init__(self, keep, kind):
        self.keep, self.kind = keep, kind
        self.tail, self.report, self.partial = bytearray(), {}, b""

    def feed(self, chunk):
        """Takes what the pipe gave; False: it is closed."""
        if not chunk:
            return False
        self.tail += chunk
        if len(self.tail) > 2 * self.keep:
            del self.tail[:len(self.tail) - self.keep]
        self.partial = read_report(self.partial + chunk, self.report, self.kind)
        return True

    def finish(self):
        """The report, with the output's last line read too."""
        read_report(self.partial + b"\n", self.report, self.kind)
        return self.report

    def output(self):
        return bytes(self.tail[-self.keep:]).decode("utf-8", errors="replace")


def with_summary(args):
    """pytest's options with its short summary of every test (``-rA``) where they ask for
    none: the report the second witness reads."""
    return list(args) if any(a.startswith("-r") for a in args) else [*args, "-rA"]


def read_report(data, report, kind="pytest"):
    """Read the complete lines of ``data`` into ``report`` (name -> status word) as SWE-bench's
    log parser for the runner (pytest's, Django's, sympy's) reads a log; returns what is left
    of an incomplete last line."""
    *lines, rest = data.split(b"\n")
    for raw in lines:
        if len(raw) > MAX_LINE:
            continue
        if kind == "django":
            read_django_line(raw.decode("utf-8", errors="replace"), report)
            continue
        if kind == "sympy":
            read_sympy_line(raw.decode("utf-8", errors="replace"), report)
            continue
        if not raw.startswith(STATUS_WORDS_B):
            continue
        words = raw.decode("utf-8", errors="replace").replace(" - ", " ").split()
        if len(words) > 1 and words[0] in STATUS_WORDS and (
                words[1] in report or len(report) < MAX_WITNESS):
            report[words[1]] = words[0]
    return b"" if len(rest) > MAX_LINE else rest


def _said(report, name, status):
    if name in report or len(report) < MAX_WITNESS:
        report[name] = status


def read_sympy_line(line, report):
    """A line of bin/test's log as swebench's ``parse_log_sympy`` reads it: a failure's
    header (``____ path.py:name ____``) is a failure of ``path.py:name``; a line that starts
    with ``test_`` says its test's status by its last word (``E``, ``F``, ``ok``)."""
    header = SYMPY_HEADER.search(line)
    if header:
        _said(report, f"{header.group(2)}.py:{header.group(3)}", "FAILED")
    line = line.strip()
    if line.startswith("test_"):
        for end, status in ((" E", "ERROR"), (" F", "FAILED"), (" ok", "PASSED")):
            if line.endswith(end):
                _said(report, line.split()[0], status)


def read_django_line(line, report):
    """A line of Django's verbose unittest log as swebench's ``parse_log_django`` reads it,
    line by line (the test a line's `` ... `` begins is remembered: an ``ok`` on a later
    line of its own passes it)."""
    line = line.strip()
    if "--version is equivalent to version" in line:
        _said(report, "--version is equivalent to version", "PASSED")
    if " ... " in line:
        report_state["prev"] = line.split(" ... ")[0]
    for suffix in (" ... ok", " ... OK", " ...  OK"):
        if line.endswith(suffix):
            if line.startswith("Applying sites.0002_alter_domain_unique...test_no_migrations"):
                line = line.split("...", 1)[-1].strip()
            _said(report, line.rsplit(suffix, 1)[0], "PASSED")
            break
    if " ... skipped" in line:
        _said(report, line.split(" ... skipped")[0], "SKIPPED")
    if line.endswith(" ... FAIL"):
        _said(report, line.split(" ... FAIL")[0], "FAILED")
    if line.startswith("FAIL:") and len(line.split()) > 1:
        _said(report, line.split()[1].strip(), "FAILED")
    if line.endswith(" ... ERROR"):
        _said(report, line.split(" ... ERROR")[0], "ERROR")
    if line.startswith("ERROR:") and len(line.split()) > 1:
        _said(report, line.split()[1].strip(), "ERROR")
    if line.lstrip().startswith("ok") and report_state.get("prev") is not None:
        _said(report, report_state["prev"], "PASSED")


def witnessed(outcomes, report, kind="pytest"):
    """The outcomes with the runner's report as a second witness, and the tests on which the
    two contradict each other (test, what the report said). A pytest test is known in the
    report by its name up to its first blank (as SWE-bench keys a log), a Django or sympy
    one by its whole name; a name several tests share is not read."""
    names = {}
    pass_words = PASS_WORDS if kind == "pytest" else RUNNER_PASS_WORDS
    for test in outcomes:
        names.setdefault((test.split() or [test])[0] if kind == "pytest" else test,
                         []).append(test)
    out, contradicted = dict(outcomes), []
    for name, tests in names.items():
        if len(tests) > 1:
            continue
        test = tests[0]
        said, want = report.get(name), pass_words.get(outcomes[test])
        if want is not None and said is None:
            out[test] = "missing"  # pytest did not say it passed: no pass
        elif want is not None and said not in want:
            out[test] = "failed"
            contradicted.append((test, said))
        elif want is None and said == "PASSED":  # pytest says passed, the records do not
            contradicted.append((test, said))
    return out, contradicted


def decide(wanted, records, xfail=False):
    """Each named test's outcome from the child's records (``xfail``: tell expected
    failures, ``xfail``, and unexpected passes, ``xpass``, apart, as pytest's summary
    does). A repository's own runner (Django's, sympy's) sends one ``result`` per test: its
    last one is its outcome, a pass only where the runner's wrapper saw the test method
    return (Django's; sympy's runner passes a test only where it returned)."""
    phases = {t: {} for t in wanted}
    results = {}
    for rec in records:
        if rec.get("kind") == "report" and rec.get("test") in phases:
            phases[rec["test"]][rec.get("when")] = rec
        elif rec.get("kind") == "result" and rec.get("test") in phases:
            results[rec["test"]] = rec
    outcomes = {}
    for test, seen in phases.items():
        if not seen and test in results:
            rec = results[test]
            outcome = rec.get("outcome") if rec.get("outcome") in OUTCOMES else "failed"
            outcomes[test] = "failed" if outcome == "passed" and \
                rec.get("returned") is False else outcome
            continue
        call = seen.get("call")
        if any(p.get("outcome") == "failed" for w, p in seen.items() if w != "call"):
            outcomes[test] = "error"
        elif call is not None and call.get("outcome") == "failed":
            outcomes[test] = "failed"
        elif any(p.get("outcome") == "skipped" for p in seen.values()):
            outcomes[test] = ("xfail" if xfail and call is not None and call.get("xfail")
                              else "skipped")
        elif call is None or "teardown" not in seen:
            outcomes[test] = "missing"
        elif call.get("outcome") == "passed" and call.get("returned") is True:
            outcomes[test] = "xpass" if xfail and call.get("xfail") else "passed"
        else:
            outcomes[test] = "failed"
    return outcomes


if __name__ == "__main__":
    main()
