"""The child that runs a repository's tests for ``swe_harness.py`` (run as ``python3 -I -c``
with this text, in the jail where it can make one). The repository's code runs in this
process (the tests import it), so nothing here decides the verdict: this process only
sends evidence, test by test, to the harness over a pipe, each record prefixed with a key
it read from its stdin before any repository code ran (raw ``os.read``, kept in a closure),
and the harness decides.

Before pytest or the repository is imported, an audit hook (PEP 578: it cannot be removed
from Python code) watches the process. *Untrusted* code is code that is not the
interpreter's, the environment's, this runner's (compiled under a name the harness made up)
or one of the repository's files as they were when the run started (path, size, mtime,
inode): a file the candidate changed (the harness names them), a file the run wrote, code
compiled from a string. When untrusted code obtains a frame or a frame's code (directly, or
through a standard-library function that hands frames back), walks the heap, installs a
trace, profile or signal function, builds code objects (``compile``, ``exec``,
``code.replace``, ``marshal.loads``), reads memory through ``ctypes``, opens
``/proc/*/mem``, or opens a test file by any spelling of its path; when anything but the
import system or the environment's packages compiles code under a trusted name; when a
repository file rewritten during the run, or bytecode that was not there at the start, is
loaded, the hook sends a ``suspicious`` record and ends the process at once: the candidate
gets reward 0.

When collection ends and before each test's call, a fixture, a hook implementation or a
test's function whose code is untrusted (an autouse fixture set on the test module from the
package, a plugin named by ``pytest_plugins`` set there, a test function swapped through the
module's class) is ``suspicious`` too.

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
    repo = os.path.realpath(request["repo"])
    wanted = set(request["tests"])
    changed = {os.path.realpath(os.path.join(repo, p)) for p in request["changed"]}
    test_files = {os.path.realpath(os.path.join(repo, p)) for p in request["test_files"]}
    stdlib = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                    for k in ("stdlib", "platstdlib")})
    site = tuple({os.path.realpath(p) + os.sep for p in sys.path if "-packages" in p})
    # The repository's own code: its Python files as they are now, before anything of it
    # runs, less what the candidate changed. Code from anywhere else (a file the run writes,
    # a string compiled under any name) is the candidate's as much as a changed file is.
    def stamp(path):
        """(size, mtime, inode) of a file, or None if it is not there."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns, st.st_ino

    original = {}  # path -> stamp: a file rewritten during the run is not the original
    bytecode = {}  # the same for the compiled files there at the start (an environment's)
    for root, dirs, names in os.walk(repo):
        dirs[:] = [d for d in dirs if d != ".git"]
        for n in names:
            if n.endswith((".py", ".pyc")):
                path = os.path.realpath(os.path.join(root, n))
                if path not in changed:
                    (original if n.endswith(".py") else bytecode)[path] = stamp(path)

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
               "marshal.loads"}
    local = threading.local()
    getframe = sys._getframe

    known = {}

    def file_of(frame):
        name = frame.f_code.co_filename
        path = known.get(name)
        if path is None:
            path = name if name.startswith("<") else os.path.realpath(os.path.join(repo, name))
            known[name] = path
        return path

    def is_stdlib(path):
        return (path.startswith("<frozen ") or path.startswith(stdlib)) and \
            not path.startswith(site)

    runner_name = request.get("runner", "")
    import ast
    ast_file = os.path.realpath(ast.__file__)

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
            os.path.realpath(os.path.join(repo, filename))
        if untrusted(path) or path.startswith("<frozen "):
            return None
        if path in original and stamp(path) != original[path]:  # not the file of the start
            return f"{path}, rewritten during the run"
        made_by = file_of(caller)
        # The import system, the environment's packages (pytest's assertion rewriting), and
        # ast.parse (a tree, not code) compile trusted files; nothing else does.
        if made_by.startswith("<frozen importlib") or made_by == ast_file or (
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
            elif event in direct_events:
                where = file_of(caller) if untrusted(file_of(caller)) else None
                if where is None and event == "compile" and len(args) > 1:
                    forged = forged_name(caller, args[1])
                    where = f"code compiled as {forged}" if forged else None
                if where is None and event == "marshal.loads":
                    where = cached_code_in_repo(caller)
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
    pytest_dirs = tuple(os.path.dirname(os.path.realpath(m.__file__)) + os.sep
                        for m in (_pytest, pluggy))

    def pytests_own(value):
        function = value.fget if isinstance(value, property) else value
        code = getattr(function, "__code__", None)
        return code is not None and os.path.realpath(code.co_filename).startswith(pytest_dirs)

    def tampered():
        for name, module in guarded.items():
            if sys.modules.get(name) is not module:
                return f"sys.modules[{name!r}] replaced"
        for owner, saved in snapshot:
            current = vars(owner)
            for key, value in saved.items():
                now = current.get(key)
                if now is not value and not (key in patched_by_pytest and pytests_own(now)):
                    return f"{getattr(owner, '__name__', owner)}.{key} replaced"
        return None

    # -- the evidence -------------------------------------------------------------------

    returned = {}  # nodeid -> whether its call returned (seen by our own wrapper)

    def code_file(value):
        """The file of a function's (or a method's, or a callable's) code, or None."""
        function = getattr(value, "__func__", value)
        code = getattr(function, "__code__", None)
        if code is None:
            code = getattr(getattr(type(value), "__call__", None), "__code__", None)  # noqa: B004
        return None if code is None else (code.co_filename if code.co_filename.startswith(
            "<") else os.path.realpath(os.path.join(repo, code.co_filename)))

    def foreign_hooks(config):
        """A hook implementation in force from untrusted code (a plugin the candidate's code
        registered, however it got to the plugin manager), or None."""
        for name in dir(config.hook):
            caller = getattr(config.hook, name, None)
            for impl in getattr(caller, "get_hookimpls", lambda: [])():
                path = code_file(impl.function)
                if path is not None and untrusted(path):
                    return f"hook {name} from {path}"
        return None

    def foreign_fixtures(session):
        """A fixture (autouse or not) defined by untrusted code, or None."""
        manager = getattr(session, "_fixturemanager", None)
        for name, defs in getattr(manager, "_arg2fixturedefs", {}).items():
            for fixturedef in defs:
                path = code_file(getattr(fixturedef, "func", None))
                if path is not None and untrusted(path):
                    return f"fixture {name} from {path}"
        return None

    def foreign_test(item):
        """The test's function, if untrusted code made or swapped it, or None."""
        obj = getattr(item, "obj", None)
        path = code_file(obj) if obj is not None else None
        if path is not None and untrusted(path):
            return f"{item.nodeid}: its function comes from {path}"
        return None

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
