"""The child that runs a repository's tests for ``swe_harness.py`` (run as ``python3 -I -c``
with this text, in the jail where it can make one). The repository's code runs in this
process (the tests import it), so nothing here decides the verdict: this process only
sends evidence, test by test, to the harness over a pipe, each record prefixed with a key
it read from its stdin before any repository code ran (raw ``os.read``, kept in a closure),
and the harness decides.

Before pytest or the repository is imported, an audit hook (PEP 578: it cannot be removed
from Python code) watches the process. *Untrusted* code is code that is not the
interpreter's, the environment's, this runner's (compiled under a name the harness made up)
or one of the repository's files whose content is the base's or the test patch's (by
SHA-256, the hashes from the farm and the harness), as they were when the run started
(path, size, mtime, inode): a file the candidate changed, one that setup or the run wrote,
a link, code compiled from a string. A path is compared as code names it, never resolved.
When untrusted code obtains a frame or a frame's code (directly, or
through a standard-library function that hands frames back), walks the heap, installs a
trace, profile, audit or signal function, builds code objects under names of its choosing
(``code.replace``, ``marshal.loads``), reads memory through ``ctypes``, opens
``/proc/*/mem``, or opens a test file by any spelling of its path; when anything but the
import system or the environment's packages compiles code under a trusted name (code
compiled from a string under its own name stays its maker's, and may run); when a
repository file rewritten during the run, or bytecode that was not there at the start, is
loaded, the hook sends a ``suspicious`` record and ends the process at once: the candidate
gets reward 0.

When collection ends and before each test's call, a fixture, a hook implementation or a
test's function whose code is untrusted (an autouse fixture set on the test module from the
package, a plugin named by ``pytest_plugins`` set there, a test function swapped through the
module's class) is ``suspicious`` too; so is a test whose file defines the function its id
names (the harness parsed the protected files before the tests started) and that runs
anything else (another test of the file, a helper, a callable without code), and a
fixture or hook of a protected file that serves under another name than its own. In
pytest's rewritten asserts (``==``) and unittest's ``assertEqual``, an object whose class's
``__eq__`` is untrusted, found equal to a value of a built-in type, is asked about values it
cannot honestly equal, the real question at a random place among them: agreeing with any
is ``suspicious``.

Before each named test runs, and at each of its reports, the functions and classes of
pytest, pluggy, unittest, numpy.testing (where installed) and the builtins are checked
against the objects they were before any repository code ran (a module, a class attribute
or ``sys.modules`` entry replaced, or an item's ``runtest`` overridden on the instance, is
``suspicious``). And a test counts as
passed only if this process's own wrapper around its call saw it return, besides pytest's
reports of its setup, call and teardown.
"""


def main():
    import builtins
    import json
    import os
    import sys
    import sysconfig
    import threading

    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(0, 65536)
        if not chunk:
            os._exit(2)
        data += chunk
    request = json.loads(data)
    data = None
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # No bytecode written by this process (-I ignores PYTHONDONTWRITEBYTECODE; its children
    # get it): bytecode that appears in the repository during the run is someone's doing.
    sys.dont_write_bytecode = True
    prefix = (request.pop("key") + " ").encode()
    fd = request["fd"]
    given = os.path.normpath(request["repo"])
    repo = os.path.realpath(given)
    wanted = set(request["tests"])
    changed = {os.path.realpath(os.path.join(repo, p)) for p in request["changed"]}
    test_files = {os.path.realpath(os.path.join(repo, p)) for p in request["test_files"]}
    # Trusted places by the paths the interpreter gives them, as given and resolved (both
    # read-only here): a path is compared as code names it, never resolved (a link the
    # candidate makes, or re-points after an import, does not make its code trusted).
    stdlib = tuple({q + os.sep for k in ("stdlib", "platstdlib")
                    for q in (os.path.normpath(sysconfig.get_paths()[k]),
                              os.path.realpath(sysconfig.get_paths()[k]))})
    site = tuple({q + os.sep for p in sys.path if "-packages" in p
                  for q in (os.path.normpath(p), os.path.realpath(p))})
    # The repository's own code: its Python files as they are now, before anything of it
    # runs, whose content is the base's (the farm hashed it before any instance command
    # ran) or the test patch's (the harness's), under either spelling of the repository's
    # path, links left out. Code from anywhere else (a file the candidate changed, one that
    # setup or the run wrote, a string compiled under any name) is the candidate's.
    import hashlib

    trusted = request.get("trusted")

    def stamp(path):
        """(size, mtime, inode) of a file, or None if it is not there."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns, st.st_ino

    def content_is_trusted(path, rel):
        if trusted is None:  # a spec without hashes: the files less the changed ones
            return os.path.realpath(path) not in changed
        try:
            with open(path, "rb") as f:
                return trusted.get(rel) == hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return False

    original = {}  # path -> stamp: a file rewritten during the run is not the original
    bytecode = {}  # the same for the compiled files there at the start (an environment's)
    for root, dirs, names in os.walk(repo):
        dirs[:] = [d for d in dirs if d != ".git"]
        for n in names:
            full = os.path.join(root, n)
            if not n.endswith((".py", ".pyc")) or os.path.islink(full):
                continue
            rel = os.path.relpath(full, repo)
            if n.endswith(".pyc"):
                bytecode[os.path.realpath(full)] = stamp(full)
            elif content_is_trusted(full, rel):
                for spelling in {repo, given}:
                    original[os.path.join(spelling, rel)] = stamp(full)

    def emit(kind, **fields):
        os.write(fd, prefix + (json.dumps({"kind": kind, **fields}) + "\n").encode())

    # -- the audit hook -----------------------------------------------------------------

    frame_attrs = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_code", "gi_code",
                   "cr_code", "ag_code"}
    watched = {"sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile",
               "gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.string_at",
               "ctypes.wstring_at", "ctypes.cdata", "ctypes.addressof", "code.__new__",
               "object.__getattr__", "object.__setattr__", "open", "compile", "exec",
               "os.link", "os.rename", "os.symlink",
               "marshal.loads", "sys.addaudithook"}
    local = threading.local()
    getframe = sys._getframe

    known = {}

    def path_of(code):
        """The path of a code object's file as it names it, made absolute (or its ``<...>``
        name): never resolved through links."""
        name = code.co_filename
        path = known.get(name)
        if path is None:
            path = name if name.startswith("<") else os.path.normpath(os.path.join(repo, name))
            known[name] = path
        return path

    def file_of(frame):
        return path_of(frame.f_code)

    def is_stdlib(path):
        return (path.startswith("<frozen ") or path.startswith(stdlib)) and \
            not path.startswith(site)

    runner_name = request.get("runner", "")
    import ast
    ast_files = {os.path.normpath(ast.__file__), os.path.realpath(ast.__file__)}

    def untrusted(path):
        """Code that is not the interpreter's, the environment's, the repository's own or
        this runner's: changed files, files the run made, code compiled from strings."""
        if path in original or path.startswith(stdlib) or path.startswith(site) or \
                path == runner_name:
            return False
        return not path.startswith("<frozen ")

    def forged_name(caller, filename):
        """A compile under the name of trusted code (so that its frames would pass for
        trusted), asked for by anything but the import system or the environment's packages
        (pytest's assertion rewriting): the name it claims, or None."""
        if not isinstance(filename, str):
            return None
        path = filename if filename.startswith("<") else \
            os.path.normpath(os.path.join(repo, filename))
        if untrusted(path) or path.startswith("<frozen "):
            return None
        if path in original and stamp(path) != original[path]:  # not the file of the start
            return f"{path}, rewritten during the run"
        made_by = file_of(caller)
        # The import system, the environment's packages (pytest's assertion rewriting), and
        # ast.parse (a tree, not code) compile trusted files; nothing else does.
        if made_by.startswith("<frozen importlib") or made_by in ast_files or (
                made_by.startswith(site) and not untrusted(made_by)):
            return None
        return f"{path} (by {made_by})"

    def cached_code_in_repo(caller):
        """A marshal.loads by the import system of bytecode from the repository that was
        not there, as it is, when the run started: the run wrote it."""
        if not file_of(caller).startswith("<frozen importlib"):
            return None
        path = caller.f_locals.get("bytecode_path")
        if not isinstance(path, str):
            return None
        path = os.path.realpath(path)
        if not path.startswith(repo + os.sep):
            return None
        now = stamp(path)
        if now is not None and bytecode.get(path) == now:
            return None
        return f"bytecode {path}, written during the run"

    # Standard-library functions that hand a frame they obtain back to their caller:
    # (the file's last two path parts, the function's name).
    hands_frames = {("inspect.py", "currentframe"), ("inspect.py", "stack"),
                    ("inspect.py", "trace"), ("inspect.py", "getouterframes"),
                    ("inspect.py", "getinnerframes"), ("traceback.py", "walk_stack"),
                    ("traceback.py", "walk_tb"), ("logging/__init__.py", "<lambda>"),
                    ("logging/__init__.py", "currentframe")}

    def tail(path):
        parts = path.replace(os.sep, "/").split("/")
        return parts[-1] if parts[-1] != "__init__.py" else "/".join(parts[-2:])

    def frame_origin(frame):
        """For an event that yields a frame: the untrusted code that gets it, or None. The
        frame's taker if untrusted; through a standard-library function that hands frames
        back (inspect.currentframe, logging.currentframe, traceback.walk_stack...), that
        function's caller. Frames the standard library uses itself (logging's caller
        lookup, namedtuple's module name) are nobody's business."""
        path = file_of(frame)
        if untrusted(path):
            return path
        code = frame.f_code
        if is_stdlib(path) and (tail(path), code.co_name) in hands_frames \
                and frame.f_back is not None and untrusted(file_of(frame.f_back)):
            return file_of(frame.f_back)
        return None

    def first_origin(frame):
        """For any other event: the first caller outside the standard library, if it is
        untrusted (ctypes, threading.settrace and the like act for their caller)."""
        while frame is not None and is_stdlib(file_of(frame)):
            frame = frame.f_back
        if frame is not None and untrusted(file_of(frame)):
            return file_of(frame)
        return None

    frame_events = {"sys._getframe", "sys._current_frames", "object.__getattr__"}
    # Code made at run time, judged by who asked for it directly (namedtuple's and
    # dataclasses' own exec are the standard library's business).
    direct_events = {"compile", "exec", "marshal.loads"}

    test_tails = {t.replace(os.sep, "/") for t in test_files}

    def is_test_file(path):
        """A test file, by any spelling of its path: resolved against the repository; and a
        relative path that ends one (it may be relative to a directory descriptor, which the
        audit event does not carry)."""
        if os.path.realpath(os.path.join(repo, path)) in test_files:
            return True
        if os.path.isabs(path):
            return False
        tail = "/" + os.path.normpath(path).replace(os.sep, "/").lstrip("./")
        return any(t.endswith(tail) for t in test_tails)

    def hook(event, args):
        if event not in watched:
            return
        if event == "object.__getattr__" and args[1] not in frame_attrs:
            return
        if event == "object.__setattr__" and args[1] != "__code__":
            return
        if event in ("open", "os.link", "os.rename", "os.symlink"):
            path = args[0]
            if isinstance(path, bytes):
                path = path.decode(errors="replace")
            if not isinstance(path, str):
                return
            if event == "open" and path.startswith("/proc/") and path.endswith("/mem"):
                emit("suspicious", event="open", detail=path)
                os._exit(3)
            if not is_test_file(path):
                return
        if getattr(local, "busy", False):
            return
        local.busy = True
        try:
            caller = getframe(1)
            if caller is None:
                where = None
            elif event in frame_events:
                where = frame_origin(caller)
            elif event == "compile":
                # Code compiled from a string is its maker's: untrusted under its own name
                # (``<string>``), whoever compiles it; only a trusted name is forged.
                forged = forged_name(caller, args[1]) if len(args) > 1 else None
                where = f"code compiled as {forged}" if forged else None
            elif event == "exec":
                where = None  # a code object keeps the name it was compiled under
            elif event == "marshal.loads":  # code objects under any name they like
                where = file_of(caller) if untrusted(file_of(caller)) else \
                    cached_code_in_repo(caller)
            else:
                where = first_origin(caller)
            if where is not None:
                emit("suspicious", event=event, detail=str(args[1] if event.startswith(
                    "object.") else "" if event in direct_events else args[0] if args
                    else "")[:200], where=where)
                os._exit(3)
        finally:
            local.busy = False

    # Off where the repository under test is the test runner itself (pytest's own tests):
    # its code is the candidate's, and what it does to run tests (read test files, walk
    # frames) is what the hook forbids. The harness says so in the verdict.
    guard = request.get("guard", True)
    if guard:
        sys.addaudithook(hook)

    # -- what must not change -----------------------------------------------------------

    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no plugin from an installed package
    import importlib
    import pkgutil

    import _pytest
    import pluggy
    import pytest

    # pytester is a plugin whose modules pytest rewrites when it loads them: imported here
    # first, they could not be (a warning, which a repository's `filterwarnings = error`
    # makes an error).
    rewritten = ("_pytest.pytester", "_pytest.pytester_assertions")
    for package in (_pytest, pluggy):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name in rewritten:
                continue
            try:
                importlib.import_module(info.name)
            except Exception:  # noqa: BLE001 - optional parts (e.g. for other platforms)
                pass
    # The environment's plugins (installed by the farm, named by it) before the snapshot:
    # some patch pytest as they load (hypothesis wraps FixtureFunctionMarker.__call__).
    for name in request.get("plugins", []):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - pytest reports it when it loads the plugin
            pass
    # A signal handler is handed the frame the signal interrupts: no handler from untrusted
    # code (signal.signal calls _signal.signal, which is this; both are guarded below).
    import _signal
    import signal  # noqa: F401 - guarded with _signal
    import unittest  # noqa: F401 - its assertions are guarded too
    real_signal = _signal.signal

    def signal_guard(signalnum, handler):
        if guard:
            where = first_origin(getframe(1))
            if where is not None:
                emit("suspicious", event="signal.signal", detail=str(signalnum), where=where)
                os._exit(3)
        return real_signal(signalnum, handler)

    _signal.signal = signal_guard
    guarded_prefixes = ("_pytest", "pytest", "pluggy", "unittest", "signal", "_signal")
    if not os.path.exists(os.path.join(repo, "numpy")):  # not when testing numpy itself
        try:
            import numpy.testing  # noqa: F401 - assert_allclose and friends
            guarded_prefixes += ("numpy.testing",)
        except ImportError:
            pass
    # -- equality the candidate's code claims ------------------------------------------
    # Where pytest's rewritten asserts compare with == (the assert's test, or a part of its
    # and/or/not) and in unittest's assertEqual, equality is decided here, as Python would
    # (built-in lists, tuples and dicts item by item), except that an object of a class
    # whose __eq__ is the candidate's code, compared with a value of a built-in type, is
    # also asked about values it cannot honestly equal (that value moved by a random amount,
    # a fresh object()), the real question at a random place among them: an __eq__ that
    # agrees with any of them lies, whatever it read of its argument (``suspicious``). It
    # cannot tell the real question from the others without knowing the answer.
    import random
    import secrets

    plain = (int, float, complex, str, bytes, bool, type(None), tuple, list, dict, set,
             frozenset)
    chance = random.Random(secrets.randbits(64))

    def type_attr(value, name):
        """``value``'s attribute ``name`` as its type's dicts hold it (how Python finds
        ``__eq__`` and ``__call__``), with no code of anyone's run to find it."""
        for klass in type.__getattribute__(type(value), "__mro__"):
            namespace = type.__getattribute__(klass, "__dict__")
            if name in namespace:
                return namespace[name]
        return None

    def candidates_eq(value):
        return type(value) not in plain and from_untrusted(type_attr(value, "__eq__"))

    def probes(value):
        """Values of ``value``'s type that no honest __eq__ finds equal to what ``value``
        equals."""
        kind, out = type(value), [object()]
        if kind is bool:
            out.append(not value)
        elif kind is int or kind is complex:
            out += [value + chance.choice((-1, 1)) * chance.randint(1, 10 ** 6)
                    for _ in range(2)]
        elif kind is float and value == value and abs(value) != float("inf"):
            out += [value + chance.choice((-1, 1)) * chance.uniform(1, 1000) *
                    (1 + abs(value)) for _ in range(2)]
        elif kind is str or kind is bytes:
            extra = secrets.token_hex(4)
            out += [value + (extra if kind is str else extra.encode()),
                    (extra * (len(value) // 8 + 1))[:max(len(value), 1)] if kind is str
                    else (extra.encode() * (len(value) // 8 + 1))[:max(len(value), 1)]]
        elif kind is tuple or kind is list:
            out.append(value + kind([object()]))
        elif kind is dict:
            out.append({**value, object(): None})
        elif kind is set or kind is frozenset:
            out.append(value | {object()})
        # Never the value itself (a random string of its length may be it): compared as
        # built-ins (a container of another length is unequal before any item is asked).
        return [p for p in out if type(p) is object or p != value]

    def agrees(left, right):
        try:
            return bool(left == right)
        except Exception:  # noqa: BLE001 - an __eq__ that raises claims nothing
            return False

    def asked(mine, other, left, right):
        trials = probes(other)
        trials.insert(chance.randint(0, len(trials)), None)  # None: the real question
        result = False
        for trial in trials:
            if trial is None:
                result = bool(left == right)
            elif agrees(mine, trial):
                emit("suspicious", event="compare", detail=(
                    f"{type(mine).__name__}.__eq__ agrees with {other!r:.60} and with "
                    f"{trial!r:.60}")[:200])
                os._exit(3)
        return result

    def equal(left, right, budget):
        """``left == right`` (its truth), with the candidate's __eq__ asked as above."""
        budget[0] -= 1
        if budget[0] > 0:
            for mine, other in ((left, right), (right, left)):
                if type(other) in plain and candidates_eq(mine):
                    return asked(mine, other, left, right)
            if type(left) is type(right) and type(left) in (list, tuple):
                return len(left) == len(right) and all(
                    a is b or equal(a, b, budget) for a, b in zip(left, right))
            if type(left) is type(right) is dict:
                return left.keys() == right.keys() and all(
                    left[k] is right[k] or equal(left[k], right[k], budget) for k in left)
        return bool(left == right)

    eq_name = "_prorl_eq_" + runner_name.strip("<>").rsplit("-", 1)[-1]

    def checked_eq(left, right):
        """An assert's ``left == right``."""
        return equal(left, right, [10000])

    def instrument(test):
        import ast

        if isinstance(test, ast.Compare) and len(test.ops) == 1 and \
                isinstance(test.ops[0], ast.Eq):
            return ast.copy_location(ast.Call(func=ast.Name(id=eq_name, ctx=ast.Load()),
                                              args=[test.left, test.comparators[0]],
                                              keywords=[]), test)
        if isinstance(test, ast.BoolOp):
            test.values = [instrument(v) for v in test.values]
        elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test.operand = instrument(test.operand)
        return test

    if guard:
        import ast

        import _pytest.assertion.rewrite as rewrite

        setattr(builtins, eq_name, checked_eq)
        rewrite_module = rewrite
        rewriter = rewrite.AssertionRewriter
        pytests_run = rewriter.run

        def run(self, mod):
            for node in ast.walk(mod):
                if isinstance(node, ast.Assert):
                    node.test = instrument(node.test)
            ast.fix_missing_locations(mod)
            return pytests_run(self, mod)

        rewriter.run = run
        unittests_equal = unittest.TestCase.assertEqual

        def assertEqual(self, first, second, msg=None):
            if equal(first, second, [10000]):
                return
            unittests_equal(self, first, second, msg)  # its message
            raise self.failureException(msg or f"{first!r:.200} != {second!r:.200}")

        unittest.TestCase.assertEqual = assertEqual

    guarded = {name: module for name, module in sys.modules.items()
               if name.startswith(guarded_prefixes)}
    snapshot = []

    def keep(owner, namespace):
        snapshot.append((owner, {k: v for k, v in namespace.items()
                                 if callable(v) or isinstance(v, (staticmethod, classmethod,
                                                                  property))}))

    def keep_module(module):
        keep(module, vars(module))
        for value in list(vars(module).values()):
            if isinstance(value, type) and getattr(value, "__module__", "") == \
                    module.__name__:
                keep(value, dict(vars(value)))

    keep(builtins, vars(builtins))
    for module in guarded.values():
        keep_module(module)

    def keep_late():
        """The guarded modules imported since (plugins pytest loads when it configures:
        pytester, which pytest rewrites, cannot be imported before), kept as they are now,
        before any of the repository's test modules (and so the candidate's code) is
        imported."""
        for name, module in list(sys.modules.items()):
            if name.startswith(guarded_prefixes) and name not in guarded:
                guarded[name] = module
                keep_module(module)

    # What pytest's own legacypath plugin patches at configure time (with functions of its
    # own): a change there is pytest's if the new value is defined in pytest's package.
    patched_by_pytest = {"_getini_unknown_type", "invocation_dir", "rootdir", "inifile",
                         "startdir", "fspath", "makedir"}
    pytest_dirs = tuple({os.path.dirname(q(m.__file__)) + os.sep for m in (_pytest, pluggy)
                         for q in (os.path.normpath, os.path.realpath)})

    def pytests_own(value):
        function = value.fget if isinstance(value, property) else value
        code = getattr(function, "__code__", None)
        return code is not None and path_of(code).startswith(pytest_dirs)

    test_modules = []  # the collected tests' modules (pytest rewrote their asserts)

    def tampered():
        for name, module in guarded.items():
            if sys.modules.get(name) is not module:
                return f"sys.modules[{name!r}] replaced"
        for module in test_modules:  # the helpers their asserts look up by name
            names = vars(module)
            if eq_name in names:
                return f"{module.__name__}.{eq_name}: the assert helper shadowed"
            if names.get("@py_builtins", builtins) is not builtins or names.get(
                    "@pytest_ar", rewrite_module) is not rewrite_module:
                return f"{module.__name__}: its assertion helpers replaced"
        for owner, saved in snapshot:
            current = vars(owner)
            for key, value in saved.items():
                now = current.get(key)
                if now is not value and not (key in patched_by_pytest and pytests_own(now)):
                    return f"{getattr(owner, '__name__', owner)}.{key} replaced"
        return None

    # -- the evidence -------------------------------------------------------------------

    returned = {}  # nodeid -> whether its call returned (seen by our own wrapper)

    # The grader's reading of the protected files (test files, conftests), made before the
    # tests start: path -> {"Cls::name": the lines its code may start at}, and
    # path -> {line: [(name, "Cls::name", fixture names)]}.
    defined, at_line = {}, {}
    for rel, found in request.get("defs", {}).items():
        for path in {os.path.normpath(os.path.join(spelling, rel)) for spelling in (repo, given)}:
            for qual, lines, names in found:
                defined.setdefault(path, {}).setdefault(qual, set()).update(lines)
                for line in lines:
                    at_line.setdefault(path, {}).setdefault(line, []).append(
                        (qual.rsplit("::", 1)[-1], qual, names))

    import functools
    import types

    def static(value, name):
        """``value``'s attribute ``name`` as its own or its type's dicts hold it: no
        ``__getattr__``, property or descriptor of anyone's runs (a candidate's object could
        hand back any code it likes)."""
        try:
            own = object.__getattribute__(value, "__dict__")
        except AttributeError:
            own = None
        if isinstance(own, dict) and name in own:
            return own[name]
        return type_attr(value, name)

    def reachable(value):
        """What calling ``value`` runs: [(path, first line, code, the protected file's defs
        at that line or None)], found by type, never by asking the objects: a method's
        function, a partial's, a callable object's ``__call__``; through a decorator's
        wrapper (a function that is no def of a protected file) to what it wraps (its
        closure's functions, its ``__wrapped__``, hypothesis' inner test). A def of a
        protected file is what runs: nothing below it is followed. At most 64 objects."""
        found, todo, seen = [], [value], set()
        while todo and len(seen) < 64:
            f = todo.pop(0)
            if id(f) in seen:
                continue
            seen.add(id(f))
            kind = type(f)
            if kind in (types.MethodType, staticmethod, classmethod):
                todo.append(f.__func__)
            elif kind in (functools.partial, functools.partialmethod):
                todo.append(f.func)
            elif kind is types.FunctionType:
                code = f.__code__
                path = path_of(code)
                known = at_line.get(path, {}).get(code.co_firstlineno)
                found.append((path, code.co_firstlineno, code, known))
                if known is None:  # a wrapper: what it wraps
                    for cell in f.__closure__ or ():
                        try:
                            inner = cell.cell_contents
                        except ValueError:  # an empty cell
                            continue
                        if type(inner) in (types.FunctionType, types.MethodType):
                            todo.append(inner)
                    extra = f.__dict__
                    todo += [extra[k] for k in ("__wrapped__",) if k in extra]
                    if extra.get("hypothesis") is not None:
                        todo.append(static(extra["hypothesis"], "inner_test"))
            elif kind is not type and not isinstance(f, (int, float, str, bytes, tuple, list,
                                                         dict, set, frozenset)):
                call = static(f, "__call__")
                if type(call) in (types.FunctionType, types.MethodType):
                    todo.append(call)
        return found

    def code_file(value):
        """The file of the code calling ``value`` runs first, or None (no Python code)."""
        codes = reachable(value)
        return codes[0][0] if codes else None

    def qualified(nodeid):
        """(the file's path, "Cls::name") of a test id (parameters and pytest 3's "()"
        left out)."""
        file_part, _, rest = nodeid.partition("::")
        parts = [p for p in rest.split("[", 1)[0].split("::") if p and p != "()"]
        return os.path.normpath(os.path.join(repo, file_part)), "::".join(parts)

    def from_untrusted(value):
        return next((path for path, _, _, _ in reachable(value) if untrusted(path)), None)

    def serving(value, name, kind):
        """Why a fixture's or hook's function may not serve as ``name``, or None: its code
        (or what it wraps) is untrusted, or it is a def of a protected file under another
        name than the one it serves under."""
        for path, line, _, defs in reachable(value):
            if untrusted(path):
                return f"{kind} {name} from {path}"
            if defs is not None and not any(own == name or name in names
                                            for own, _, names in defs):
                return f"{kind} {name} runs {defs[0][1]} ({path}:{line})"
        return None

    def foreign_hooks(config):
        """A hook implementation in force from untrusted code (a plugin the candidate's code
        registered, however it got to the plugin manager), or one of a protected file's
        defs serving another hook than its own; None if none is."""
        for name in dir(config.hook):
            caller = getattr(config.hook, name, None)
            for impl in getattr(caller, "get_hookimpls", lambda: [])():
                why = serving(impl.function, (getattr(impl, "opts", None) or {}).get(
                    "specname") or name, "hook")
                if why is not None:
                    return why
        return None

    def foreign_fixtures(session):
        """A fixture (autouse or not) defined by untrusted code, or one of a protected
        file's defs serving as another fixture than its own; None if none is."""
        manager = getattr(session, "_fixturemanager", None)
        for name, defs in getattr(manager, "_arg2fixturedefs", {}).items():
            for fixturedef in defs:
                why = serving(getattr(fixturedef, "func", None), name, "fixture")
                if why is not None:
                    return why
        return None

    def foreign_test(item):
        """Why the test does not run the function its id names, or None: its function (or
        what that wraps) comes from untrusted code, or has no Python code, or, where the
        test's file defines the function its id names, is not that def (another test's, a
        helper's, a function a factory made)."""
        obj = getattr(item, "obj", None)
        if obj is None:
            return None
        codes = reachable(obj)
        for path, _, _, _ in codes:
            if untrusted(path):
                return f"{item.nodeid}: its function comes from {path}"
        if not codes:
            return f"{item.nodeid}: runs {type(obj).__name__}, which has no Python code"
        path, qual = qualified(item.nodeid)
        lines = defined.get(path, {}).get(qual)
        if lines is None:  # no def of its file by that name (inherited, assigned, made)
            return None
        defs = [(p, line, code) for p, line, code, known in codes if known is not None]
        if defs and all(p == path and line in lines for p, line, _ in defs):
            return None
        p, line, code = (defs or [c[:3] for c in codes])[0]
        return (f"{item.nodeid}: runs {code.co_name} ({p}:{line}), not the function its file "
                f"defines for it (line {min(lines)})")

    def check(where, item=None, session=None):
        if not guard:
            return
        why = tampered()
        if why is None and item is not None and "runtest" in vars(item):
            why = f"{item.nodeid}: runtest overridden on the item"
        if why is None and item is not None:
            why = foreign_test(item) or foreign_hooks(item.config) or \
                foreign_fixtures(item.session)
        if why is None and session is not None:
            why = foreign_hooks(session.config) or foreign_fixtures(session) or next(
                (w for w in map(foreign_test, session.items) if w), None)
        if why is not None:
            emit("suspicious", event=where, detail=why)
            os._exit(3)

    class Evidence:
        @pytest.hookimpl(trylast=True)
        def pytest_configure(self, config):
            keep_late()

        @pytest.hookimpl(tryfirst=True)
        def pytest_collection_modifyitems(self, session, config, items):
            if every_test:  # SWE-bench runs the whole files; every test has its say
                wanted.update(i.nodeid for i in items)
                return
            keep_items = [i for i in items if i.nodeid in wanted]
            dropped = [i for i in items if i.nodeid not in wanted]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = keep_items

        @pytest.hookimpl(trylast=True)
        def pytest_collection_finish(self, session):
            for item in session.items:
                module = getattr(item, "module", None)
                if module is not None and all(module is not m for m in test_modules):
                    test_modules.append(module)
            check("collected", session=session)
            emit("collected", tests=[i.nodeid for i in session.items])

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            check("before call", item)
            outcome = yield
            returned[item.nodeid] = outcome.excinfo is None

        def pytest_runtest_logreport(self, report):
            if report.nodeid not in wanted:
                return
            check("report")
            emit("report", test=report.nodeid, when=report.when, outcome=report.outcome,
                 returned=returned.get(report.nodeid, False) if report.when == "call"
                 else None, xfail=hasattr(report, "wasxfail"))

    plugin = Evidence()
    files = request["files"]
    every_test = bool(request.get("every_test"))
    # The environment's own plugins (installed by the farm, named by it): autoloading
    # stays off, so nothing the candidate registers as an entry point is loaded.
    options = [a for m in request.get("plugins", []) for a in ("-p", m)]
    options += request.get("pytest_args", ["-q"])
    os.chdir(repo)
    sys.path.insert(0, repo)  # as `python -m pytest` from the repository's root would
    code = 0
    if files:
        try:
            code = int(pytest.main(["-p", "no:cacheprovider", "--rootdir", repo, *options,
                                    *files], plugins=[plugin]))
        except BaseException:  # noqa: BLE001 - what the tests raise is theirs
            import traceback

            traceback.print_exc()  # into the output the verdict keeps
            code = -1
    check("end")
    emit("done", exit_code=code)
    for stream in (sys.__stdout__, sys.__stderr__):  # the log's last lines (the summary)
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - the log is for reading, the evidence is sent
            pass
    os._exit(0)  # no atexit hook of the repository's runs after the evidence


main()
