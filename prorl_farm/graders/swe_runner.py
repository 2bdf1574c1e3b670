"""The child that runs a repository's tests for ``swe_harness.py`` (run as ``python3 -I -c``
with this text, in the jail where it can make one). The repository's code runs in this
process (the tests import it), so nothing here decides the verdict: this process only
sends evidence, test by test, to the harness over a pipe, each record prefixed with a key
it read from its stdin before any repository code ran (raw ``os.read``, kept in a closure),
and the harness decides.

Before pytest or the repository is imported, an audit hook (PEP 578: it cannot be removed
from Python code) watches the process. When code from a file the candidate changed (the
harness names them) obtains a frame (``sys._getframe``, a traceback's or generator's frame,
``sys._current_frames``), walks the heap (``gc.get_objects``/``get_referrers``/
``get_referents``), installs a trace or profile function, builds code objects or swaps a
function's ``__code__``, reads memory through ``ctypes``, opens ``/proc/*/mem``, or opens a
test file (directly or through ``inspect``/``linecache``/``traceback``), the hook sends a
``suspicious`` record and ends the process at once: the candidate gets reward 0.

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
    prefix = (request.pop("key") + " ").encode()
    fd = request["fd"]
    repo = request["repo"]
    wanted = set(request["tests"])
    changed = {os.path.join(repo, p) for p in request["changed"]}
    test_files = {os.path.join(repo, p) for p in request["test_files"]}
    stdlib = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                    for k in ("stdlib", "platstdlib")})
    site = tuple({os.path.realpath(p) + os.sep for p in sys.path if "-packages" in p})

    def emit(kind, **fields):
        os.write(fd, prefix + (json.dumps({"kind": kind, **fields}) + "\n").encode())

    # -- the audit hook -----------------------------------------------------------------

    frame_attrs = {"tb_frame", "gi_frame", "cr_frame", "ag_frame"}
    watched = {"sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile",
               "gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.string_at",
               "ctypes.wstring_at", "ctypes.cdata", "ctypes.addressof", "code.__new__",
               "object.__getattr__", "object.__setattr__", "open"}
    local = threading.local()
    getframe = sys._getframe

    def file_of(frame):
        name = frame.f_code.co_filename
        return name if name.startswith("/") else os.path.join(repo, name)

    def is_stdlib(path):
        return (path.startswith("<") or path.startswith(stdlib)) and not path.startswith(site)

    # Standard-library functions that hand a frame they obtain back to their caller.
    hands_frames = {("inspect.py", "currentframe"), ("inspect.py", "stack"),
                    ("inspect.py", "trace"), ("inspect.py", "getouterframes"),
                    ("inspect.py", "getinnerframes"), ("traceback.py", "walk_stack"),
                    ("traceback.py", "walk_tb")}

    def frame_origin(frame):
        """For an event that yields a frame: the changed file that gets it, or None. The
        frame's taker if changed; through a standard-library function that hands frames
        back (inspect.currentframe, traceback.walk_stack...), that function's caller.
        Frames the standard library uses itself (logging's caller lookup, namedtuple's
        module name) are nobody's business."""
        path = file_of(frame)
        if path in changed:
            return path
        code = frame.f_code
        if (os.path.basename(code.co_filename), code.co_name) in hands_frames \
                and frame.f_back is not None and file_of(frame.f_back) in changed:
            return file_of(frame.f_back)
        return None

    def first_origin(frame):
        """For any other event: the first caller outside the standard library, if it is a
        changed file (ctypes, threading.settrace and the like act for their caller)."""
        while frame is not None and is_stdlib(file_of(frame)):
            frame = frame.f_back
        if frame is not None and file_of(frame) in changed:
            return file_of(frame)
        return None

    frame_events = {"sys._getframe", "sys._current_frames", "object.__getattr__"}

    def hook(event, args):
        if event not in watched:
            return
        if event == "object.__getattr__" and args[1] not in frame_attrs:
            return
        if event == "object.__setattr__" and args[1] != "__code__":
            return
        if event == "open":
            path = args[0]
            if isinstance(path, bytes):
                path = path.decode(errors="replace")
            if not isinstance(path, str):
                return
            if path.startswith("/proc/") and path.endswith("/mem"):
                emit("suspicious", event="open", detail=path)
                os._exit(3)
            if os.path.join(repo, path) not in test_files:
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
            else:
                where = first_origin(caller)
            if where is not None:
                emit("suspicious", event=event, detail=str(args[1] if event.startswith(
                    "object.") else args[0] if args else "")[:200], where=where)
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
    import unittest  # noqa: F401 - its assertions are guarded too
    guarded_prefixes = ("_pytest", "pytest", "pluggy", "unittest")
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

    keep(builtins, vars(builtins))
    for module in guarded.values():
        keep(module, vars(module))
        for value in list(vars(module).values()):
            if isinstance(value, type) and getattr(value, "__module__", "") == \
                    module.__name__:
                keep(value, dict(vars(value)))

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

    def check(where, item=None):
        if not guard:
            return
        why = tampered()
        if why is None and item is not None and "runtest" in vars(item):
            why = f"{item.nodeid}: runtest overridden on the item"
        if why is not None:
            emit("suspicious", event=where, detail=why)
            os._exit(3)

    class Evidence:
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
