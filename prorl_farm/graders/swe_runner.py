"""The child that runs a repository's tests for ``swe_harness.py`` (run as ``python3 -I -c``
with this text, in the jail where it can make one, in a globals dict of its own with a copy
of the builtins: no module holds what this code looks names up in). The repository's code
runs in this process (the tests import it), so nothing here decides the verdict: this
process only sends evidence, test by test, to the harness over a pipe, each record prefixed
with a key it read from its stdin before any repository code ran (raw ``os.read``), which
only the audit hook's sender holds: the runner's functions are reachable from the tests,
its key and its judges are not (see ``evidence_channel``, ``audit_hook``,
``instrument_asserts``). The harness decides (with pytest's own report of the run as a
second witness).

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
fixture or hook of a protected file that serves under another name than its own.

Equality: in pytest's rewritten asserts (``==``) and unittest's ``assertEqual``, an object
of any but a built-in value type, found equal to a value of a built-in type, is asked about
values it cannot honestly equal, the real question at a random place among them: agreeing
with any is ``suspicious``, wherever its ``__eq__`` was defined (``mock.ANY`` written by the
test itself excepted).

Frozen: each test module and its classes are kept as the module's own code left them, as
soon as its body has run; untrusted code that sets or deletes a test module's attribute is
``suspicious`` at once, and a test module's name, a class's method or the asserts' helpers
rebound by any route is found before and after each test's call, at each of its asserts and
at each report. So are the functions and classes of pytest, pluggy, unittest, numpy.testing
(where installed) and the builtins, against the objects they were before any repository
code ran (a module, a class attribute or ``sys.modules`` entry replaced, or an item's
``runtest`` overridden on the instance). And a test counts as passed only if this process's
own wrapper around its call saw it return, besides pytest's reports of its setup, call and
teardown.
"""
# The runner is built by the functions below, each returning what it builds (closures):
# ``main`` calls each once, before any of the repository's code runs. What runs later (the
# hook, the probe, the guard, the plugin) reaches everything through its closures, never
# through a module's globals: the harness runs this text in a dict of its own, with a copy
# of the builtins, which no module holds.


def read_request():
    """The harness's request, read from stdin (raw reads, before anything else runs); stdin
    is then /dev/null."""
    import json
    import os
    import sys

    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(0, 65536)
        if not chunk:
            os._exit(2)
        data += chunk
    request = json.loads(data)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # No bytecode written by this process (-I ignores PYTHONDONTWRITEBYTECODE; its children
    # get it): bytecode that appears in the repository during the run is someone's doing.
    sys.dont_write_bytecode = True
    return request


def evidence_channel(request, guard):
    """The evidence pipe. ``send(kind, fields)`` writes one record, prefixed with the key
    (popped from the request and kept in its closure alone), serialised by this closure's
    own references to C functions (no module's ``json``, which any code may rebind); a
    ``suspicious`` record ends the process. ``send`` is handed to the audit hook and to
    nothing else: no object the tests can reach holds it. ``emit(kind, **fields)``, which
    the rest of the runner calls, raises an audit event (``event``) that the hook answers
    by sending the record only where it came from the runner (``emit``'s own code, called
    by the runner's, on the main thread, with nothing but trusted code on the stack and the
    runner's functions as they were built): reaching ``emit`` through a closure gains
    nothing. Without the guard (no hook) ``emit`` sends directly."""
    import os
    import secrets
    import sys
    try:
        from _json import encode_basestring_ascii as quote
    except ImportError:  # an interpreter built without the accelerator
        from json.encoder import py_encode_basestring_ascii as quote

    prefix = (request.pop("key") + " ").encode()
    fd = request["fd"]
    write, end, audit, is_a = os.write, os._exit, sys.audit, isinstance
    exact = type
    join, as_int = ",".join, int.__repr__

    def value(v):
        kind = exact(v)
        if kind is bool:
            return "true" if v else "false"
        if v is None:
            return "null"
        if kind is int:
            return as_int(v)
        if kind is list or kind is tuple:
            return "[" + join([value(x) for x in v]) + "]"
        return quote(v if is_a(v, str) else object.__repr__(v))

    def send(kind, fields):
        body = join([quote(k) + ":" + value(v) for k, v in (("kind", kind), *fields.items())])
        write(fd, prefix + ("{" + body + "}\n").encode())
        if kind == "suspicious":
            end(3)

    event = "prorl.evidence." + secrets.token_hex(8)
    equality = "prorl.equality." + secrets.token_hex(8)  # an assert's ==: see audit_hook
    assert_equal = "prorl.assert-equal." + secrets.token_hex(8)  # a test's assertEqual
    rewritten = "prorl.rewritten." + secrets.token_hex(8)  # a test module pytest rewrote

    def emit(kind, **fields):
        audit(event, kind, fields)
        if kind == "suspicious":  # the hook has sent it, or refused it and ended the run
            end(3)

    if not guard:
        def emit(kind, **fields):  # noqa: F811 - no hook to answer the event
            send(kind, fields)

    return Built(send=send, emit=emit, event=event, emit_code=emit.__code__,
                 equality=equality, assert_equal=assert_equal, rewritten=rewritten)


def untrusted_by(original, stdlib, site, runner_name):
    """``untrusted(path)``: code that is not the interpreter's, the environment's, the
    repository's own (a path of ``original``) or this runner's: changed files, files the run
    made, code compiled from strings. Built by ``trust`` and, a copy no other code holds, by
    the audit hook."""

    def untrusted(path):
        if path in original or path.startswith(stdlib) or path.startswith(site) or \
                path == runner_name:
            return False
        return not path.startswith("<frozen ")

    return untrusted


def unittest_comparison(asserted, unittests_equal):
    """``compared(case, first, second, msg, owned)``: unittest's assertEqual, its equality
    asked of ``asserted`` (``owned``: where the test wrote ``ANY`` itself), its failure
    message unittest's own. Built by ``instrument_asserts`` and, a copy no other code holds,
    by the audit hook."""

    def compared(case, first, second, msg, owned):
        if asserted(first, second, owned):
            return
        unittests_equal(case, first, second, msg)  # its message
        raise case.failureException(msg or f"{first!r:.200} != {second!r:.200}")

    return compared


class Built:
    """What a builder returns: named closures (read into the next builder's locals when it
    is built, never looked up while tests run)."""

    def __init__(self, **parts):
        self.__dict__.update(parts)


def trust(request):
    """Whose code is whose. *Untrusted* code is code that is not the interpreter's, the
    environment's, this runner's or one of the repository's files whose content is the
    base's or the test patch's (by SHA-256), as they were when the run started."""
    import ast
    import hashlib
    import os
    import sys
    import sysconfig

    given = os.path.normpath(request["repo"])
    repo = os.path.realpath(given)
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

    # The repository's own code: its Python files as they are now, before anything of it
    # runs, whose content is the base's (the farm hashed it before any instance command
    # ran) or the test patch's (the harness's), under either spelling of the repository's
    # path, links left out. Code from anywhere else (a file the candidate changed, one that
    # setup or the run wrote, a string compiled under any name) is the candidate's.
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

    untrusted = untrusted_by(original, stdlib, site, runner_name)

    def first_origin(frame):
        """The first caller outside the standard library, if it is untrusted (ctypes,
        threading.settrace and the like act for their caller), or None."""
        while frame is not None and is_stdlib(file_of(frame)):
            frame = frame.f_back
        if frame is not None and untrusted(file_of(frame)):
            return file_of(frame)
        return None

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

    return Built(repo=repo, given=given, stdlib=stdlib, site=site, stamp=stamp,
                 original=original, bytecode=bytecode, path_of=path_of, file_of=file_of,
                 is_stdlib=is_stdlib, untrusted=untrusted, first_origin=first_origin,
                 is_test_file=is_test_file, runner_name=runner_name,
                 test_file_names=list(request["test_files"]),
                 ast_files={os.path.normpath(ast.__file__), os.path.realpath(ast.__file__)})


def audit_hook(t, channel, watchers):
    """The audit hook (PEP 578: no Python code can remove it) that ends the process with a
    ``suspicious`` record when untrusted code reaches for frames, the heap, a trace, profile
    or audit function, code objects under names of its choosing, raw memory or a test file,
    or when code compiled under a trusted name or bytecode the run wrote is loaded; and the
    one sender of the evidence (see ``evidence_channel``). Returns the hook and ``seal``,
    which hands it, once, the runner's functions as built (``runner_state``): each record
    is sent only while they are as they were. And the judge of every ``==`` of an assert
    (``instrument_asserts``): the rewritten assert raises ``equality`` through a reference
    to ``sys.audit`` in its own code's constants, which nothing can rebind, and this hook
    answers with an equality probe of its own, after checking the runner as built (a
    closure or a test module's name rebound for the moment of an assert is found at it)."""
    import _thread
    import gc
    import os
    import sys
    import threading
    import types

    stamp, original, bytecode, repo = t.stamp, t.original, t.bytecode, t.repo
    path_of, file_of, is_stdlib, untrusted = t.path_of, t.file_of, t.is_stdlib, t.untrusted
    types_file = path_of(types.coroutine.__code__)
    first_origin, is_test_file, site, ast_files = t.first_origin, t.is_test_file, t.site, \
        t.ast_files
    frame_attrs = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_code", "gi_code",
                   "cr_code", "ag_code"}
    watched = {"sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile",
               "gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.string_at",
               "ctypes.wstring_at", "ctypes.cdata", "ctypes.addressof", "code.__new__",
               "object.__getattr__", "object.__setattr__", "open", "compile", "exec",
               "os.link", "os.rename", "os.symlink", "marshal.loads", "sys.addaudithook"}
    local = threading.local()
    getframe = sys._getframe
    collecting, stop_collecting, collect_again = gc.isenabled, gc.disable, gc.enable

    class busy:
        """This hook at work: the events its own reading raises are not looked at again,
        and no garbage is collected meanwhile (a collection runs ``__del__`` methods, weakref
        and ``gc.callbacks`` functions, anyone's code, which would act unwatched)."""

        def __enter__(self):
            local.busy, self.collected = True, collecting()
            stop_collecting()

        def __exit__(self, *exc):
            local.busy = False
            if self.collected:
                collect_again()

    send, evidence, emit_code, equality, assert_equal, rewrite_done = channel.send, \
        channel.event, channel.emit_code, channel.equality, channel.assert_equal, \
        channel.rewritten
    runner_name, main_thread, get_ident = t.runner_name, _thread.get_ident(), _thread.get_ident
    # This hook's own copy of whose code is whose (no function the tests can reach).
    own_untrusted = untrusted_by(frozenset(original), t.stdlib, t.site, runner_name)
    sealed, compared = [], []
    # The probe that judges the asserts' ==: this hook's own (no object the tests can reach
    # holds it), its lies sent by this hook's sender; ``watchers``: the check of the
    # running test's module at each assert.
    judge = equality_probe(lambda kind, **fields: send(kind, fields), watchers).asserted

    def held(event):
        """The runner as built, or a ``suspicious`` record and the end of the run."""
        with busy():
            why = sealed[0].check() if sealed else None
        if why is not None:
            send("suspicious", {"event": event, "detail": why[:200]})

    def equality_asked(args):
        """An assert's ``left == right``: ``args`` are left, right, the masks of where the
        test wrote ``ANY`` (left, right) and a fresh list, which gets the answer."""
        if len(args) != 5 or type(args[4]) is not list or args[4]:
            return
        held("assert")
        args[4].append(judge(args[0], args[1], (args[2], args[3])))

    def assert_equal_asked(args):
        """A test's ``x.assertEqual(first, second, *rest, **named)``: ``args`` are the bound
        method, first, second, whether the test wrote each itself (``ANY``), rest and named.
        unittest's, judged here; anything else called as it was."""
        if len(args) != 7 or type(args[5]) is not tuple or type(args[6]) is not dict:
            return
        bound, first, second, own_first, own_second, rest, named = args
        held("assertEqual")
        if sealed and getattr(bound, "__func__", None) is sealed[0].assert_equal:
            compared[0](bound.__self__, first, second, rest[0] if rest else named.get("msg"),
                        (own_first, own_second))
            return
        bound(first, second, *rest, **named)

    def seal(state):
        if not sealed:
            sealed.append(state)
            compared.append(unittest_comparison(judge, state.unittests_equal))

    def untrusted_on_stack(frame):
        """The first frame from ``frame`` down to the bottom of the main thread's stack (the
        harness's boot, below the runner) whose code is not trusted, by this hook's own
        copies: its file, or None."""
        while frame is not None and frame.f_back is not None:
            name = frame.f_code.co_filename
            if own_untrusted(name):
                return name
            frame = frame.f_back
        return None

    def from_the_runner(caller):
        """Why a record raised as ``caller`` (the frame that raised the event) does not come
        from the runner, or None."""
        if get_ident() != main_thread:
            return "a record from another thread"
        if caller is None or caller.f_code is not emit_code:
            return "a record sent past the runner's emit"
        outer = caller.f_back
        if outer is None or outer.f_code.co_filename != runner_name:
            return "a record from outside the runner"
        where = untrusted_on_stack(outer)
        if where is not None:
            return f"a record with {where} on the stack"
        return sealed[0].check() if sealed else None

    def evidence_record(args):
        """The runner's ``emit``: the record, sent if it came from the runner as built;
        otherwise the run is ``suspicious``."""
        with busy():
            why = from_the_runner(getframe(2))
        kind, fields = (args + (None, None))[:2]
        if why is not None:
            send("suspicious", {"event": "evidence", "detail": why[:200]})
        if type(kind) is str and type(fields) is dict:
            send(kind, fields)

    def forged_name(caller, filename, source):
        """A compile under the name of trusted code (so that its frames would pass for
        trusted), asked for by anything but the import system or the environment's packages
        (pytest's assertion rewriting), or by the import system from another text than the
        file's own (``SourceFileLoader.source_to_code`` takes any): the name it claims, or
        None."""
        if not isinstance(filename, str):
            return None
        path = filename if filename.startswith("<") else \
            os.path.normpath(os.path.join(repo, filename))
        if untrusted(path):  # its own name: the code stays the candidate's
            return None
        if path in original and stamp(path) != original[path]:  # not the file of the start
            return f"{path}, rewritten during the run"
        if sealed and caller.f_code is sealed[0].compile_code:
            return None  # the runner's compile of a test file: that file's own text
        made_by = file_of(caller)
        # The import system, the environment's packages (pytest's assertion rewriting), and
        # ast.parse (a tree, not code) compile trusted files; nothing else does.
        if made_by.startswith("<frozen importlib") and isinstance(source, bytes) and \
                not path.startswith("<") and source != file_bytes(path):
            return f"{path} (from another text, by the import system)"
        if made_by.startswith("<frozen importlib") or made_by in ast_files or (
                made_by.startswith(site) and not untrusted(made_by)):
            return None
        return f"{path} (by {made_by})"

    def file_bytes(path):
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:
            return None

    def cached_code_in_repo(caller, data):
        """A marshal.loads by the import system of bytecode from the repository that was
        not there, as it is, when the run started (the run wrote it); of bytes that are not
        the named cache file's (``_compile_bytecode`` takes any, and names the code after
        any ``source_path``); or of a cache file that is not ``source_path``'s."""
        if not file_of(caller).startswith("<frozen importlib"):
            return None
        names = caller.f_locals
        path, source = names.get("bytecode_path"), names.get("source_path")
        if not isinstance(path, str):
            return "bytecode of no file, by the import system"
        on_disk = file_bytes(path)
        if on_disk is None or on_disk[16:] != bytes(data):
            return f"bytecode that is not {path}'s, by the import system"
        if isinstance(source, str) and (
                os.path.dirname(path) != os.path.join(os.path.dirname(source), "__pycache__")
                or not os.path.basename(path).startswith(
                    os.path.splitext(os.path.basename(source))[0] + ".")):
            return f"bytecode {path} under the name {source}"
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
        if not path.startswith("<") and not made_from(path, code):
            return f"{path} (code that is not the file's)"
        if is_stdlib(path) and (tail(path), code.co_name) in hands_frames \
                and frame.f_back is not None and untrusted(file_of(frame.f_back)):
            return file_of(frame.f_back)
        return None

    # Code by provenance: a frame's code object claims a trusted file by its name alone,
    # which other routes than a compile can give (``_imp._fix_co_filename`` renames code in
    # place, and a fresh ``_imp`` module from ``_imp.create_builtin`` has it unguarded). A
    # frame that acts under a trusted file's name must run code that file's text compiles
    # to (compared as code objects: name, bytecode, constants, lines...), or that pytest's
    # rewriting of it made (told to this hook by the runner's own rewriting step).
    made, code_type = {}, type(tail.__code__)

    def codes(co):
        found, todo = set(), [co]
        while todo:
            each = todo.pop()
            found.add(each)
            todo.extend(c for c in each.co_consts if type(c) is code_type)
        return found

    def compiled_from(path):
        """The code objects ``path``'s text compiles to (once), with what was added."""
        known = made.get(path)
        if known is None:
            text, known = file_bytes(path), set()
            if text is not None:
                try:
                    known = codes(compile(text, path, "exec", dont_inherit=True))
                except (SyntaxError, ValueError):
                    pass
            made[path] = known
        return known

    def made_from(path, code):
        return code in compiled_from(path)

    def rewritten(args):
        """The runner's rewriting step has compiled a test module (``args``: its path and
        its code): what the file's frames may run, besides its plain compile."""
        if len(args) == 2 and isinstance(args[0], str) and type(args[1]) is code_type:
            with busy():  # its own compile of the file, unwatched
                caller = getframe(2)
                if caller is not None and caller.f_code.co_filename == runner_name:
                    made[args[0]] = compiled_from(args[0]) | codes(args[1])

    frame_events = {"sys._getframe", "sys._current_frames", "object.__getattr__"}
    silent = {"compile", "exec", "marshal.loads"}  # their arguments are code: not quoted

    def hook(event, args):
        if event == evidence:
            evidence_record(args)
            return
        if event == equality:
            equality_asked(args)
            return
        if event == assert_equal:
            assert_equal_asked(args)
            return
        if event == rewrite_done:
            rewritten(args)
            return
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
                send("suspicious", {"event": "open", "detail": path})
            if not is_test_file(path):
                return
        if getattr(local, "busy", False):
            return
        with busy():
            caller = getframe(1)
            if caller is None:
                where = None
            elif event in frame_events:
                where = frame_origin(caller)
            elif event == "compile":
                # Code compiled from a string is its maker's: untrusted under its own name
                # (``<string>``), whoever compiles it; only a trusted name is forged.
                forged = forged_name(caller, args[1], args[0]) if len(args) > 1 else None
                where = f"code compiled as {forged}" if forged else None
            elif event == "exec":
                # A code object keeps the name it was compiled under: untrusted code may run
                # its own, not trusted code's (a trusted function's body in its globals).
                code = args[0] if args else None
                where = None
                if hasattr(code, "co_filename") and not untrusted(path_of(code)) and \
                        untrusted(file_of(caller)):  # direct: the import system runs them
                    where = file_of(caller)
            elif event in ("code.__new__", "object.__setattr__") and \
                    file_of(caller) == types_file and caller.f_code.co_name == "coroutine":
                # types.coroutine flags a generator function's own code as a coroutine's (on
                # asyncio's first import, say): it renames nothing, whoever imported it.
                where = None
            elif event == "marshal.loads":  # code objects under any name they like
                where = file_of(caller) if untrusted(file_of(caller)) else \
                    cached_code_in_repo(caller, args[0] if args else b"")
            else:
                where = first_origin(caller)
            if where is not None:
                send("suspicious", {"event": event, "detail": str(args[1] if event.startswith(
                    "object.") else "" if event in silent else args[0] if args
                    else "")[:200], "where": where})

    return Built(hook=hook, seal=seal)


def import_the_runner(request):
    """pytest, pluggy and their parts, and the environment's plugins, imported before any
    of the repository's code runs (so that what they are now can be kept)."""
    import importlib
    import os
    import pkgutil

    if request.get("kind", "pytest") != "pytest":  # Django's and sympy's: unittest, stdlib
        import unittest  # noqa: F401
        import unittest.mock  # noqa: F401
        return
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # no plugin from an installed package
    import _pytest
    import pluggy
    import pytest  # noqa: F401

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


def signal_guard(t, emit, guard):
    """A signal handler is handed the frame the signal interrupts: no handler from untrusted
    code (signal.signal calls _signal.signal, which is replaced here; both are kept). And
    no code renamed in place but by the import system (``_imp._fix_co_filename``)."""
    import _imp
    import _signal
    import signal  # noqa: F401 - guarded with _signal
    import sys

    real_signal, first_origin, getframe = _signal.signal, t.first_origin, sys._getframe

    def guarded_signal(signalnum, handler):
        if guard:
            where = first_origin(getframe(1))
            if where is not None:
                emit("suspicious", event="signal.signal", detail=str(signalnum), where=where)
        return real_signal(signalnum, handler)

    _signal.signal = guarded_signal
    # _imp._fix_co_filename renames a code object in place (no audit event): the import
    # system's, for what it has just loaded from a file's own cache; anyone else's call is
    # code under a name of its choosing.
    real_rename, file_of = _imp._fix_co_filename, t.file_of

    def guarded_rename(code, path):
        if guard and not file_of(getframe(1)).startswith("<frozen importlib"):
            emit("suspicious", event="_imp._fix_co_filename", detail=str(path)[:200],
                 where=file_of(getframe(1)))
        return real_rename(code, path)

    _imp._fix_co_filename = guarded_rename
    return Built(guarded_signal=guarded_signal, guarded_rename=guarded_rename)


def identity(t, request):
    """What a callable runs, found by type (never by asking the objects), held to the
    protected files' definitions: the checks that a test, fixture or hook runs the code its
    name says."""
    import functools
    import os
    import types

    path_of, untrusted, repo, given = t.path_of, t.untrusted, t.repo, t.given
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

    def type_attr(value, name):
        """``value``'s attribute ``name`` as its type's dicts hold it (how Python finds
        ``__eq__`` and ``__call__``), with no code of anyone's run to find it."""
        for klass in type.__getattribute__(type(value), "__mro__"):
            namespace = type.__getattribute__(klass, "__dict__")
            if name in namespace:
                return namespace[name]
        return None

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

    def from_untrusted(value):
        return next((path for path, _, _, _ in reachable(value) if untrusted(path)), None)

    def qualified(nodeid):
        """(the file's path, "Cls::name") of a test id (parameters and pytest 3's "()"
        left out)."""
        file_part, _, rest = nodeid.partition("::")
        parts = [p for p in rest.split("[", 1)[0].split("::") if p and p != "()"]
        return os.path.normpath(os.path.join(repo, file_part)), "::".join(parts)

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

    return Built(type_attr=type_attr, from_untrusted=from_untrusted,
                 foreign_hooks=foreign_hooks, foreign_fixtures=foreign_fixtures,
                 foreign_test=foreign_test)


def equality_probe(emit, watchers):
    """Equality as the asserts see it. Where pytest's rewritten asserts compare with == (the
    assert's test, or a part of its and/or/not) and in unittest's assertEqual, equality is
    decided here, as Python would (built-in lists, tuples and dicts item by item), except
    that an object of any type but a built-in value type, compared with a value of a
    built-in type, is also asked about values it cannot honestly equal (that value moved by
    a random amount, a fresh object()), the real question at a random place among them: an
    __eq__ that agrees with any of them lies, whatever it read of its argument and wherever
    it was defined (the candidate's Python, a trusted module, a C function, a partial, a
    mock: ``suspicious``). It cannot tell the real question from the others without knowing
    the answer. What is not asked: the object in a place where the test wrote ``ANY``
    itself (``{"id": ANY}``, ``[0, mock.ANY]``, a local bound once to such, a
    ``parametrize`` value that writes ANY): the rewriting tells the probe where, slot by
    slot, so an object of the candidate's elsewhere (a rebound constant beside the test's
    ``ANY``) is still asked."""
    import random
    import secrets
    plain = (int, float, complex, str, bytes, bool, type(None), tuple, list, dict, set,
             frozenset)
    chance = random.Random(secrets.randbits(64))

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
        return result

    def item(mask, index):
        """The mask of a list's or tuple's item (see ``owned_sides``)."""
        if mask is True:
            return True
        if type(mask) is tuple and mask[0] == "s" and index < len(mask[1]):
            return mask[1][index]
        return False

    def entry(mask, key):
        """The mask of a dict's value."""
        if mask is True:
            return True
        if type(mask) is tuple and mask[0] == "d":
            return next((m for k, m in mask[1] if k == key and type(k) is type(key)), False)
        return False

    def equal(left, right, budget, masks=(False, False)):
        """``left == right`` (its truth), with any non-built-in object asked as above, but
        where ``masks`` say the test wrote ``ANY`` itself."""
        budget[0] -= 1
        if budget[0] > 0:
            for mine, other, mask in ((left, right, masks[0]), (right, left, masks[1])):
                if type(other) in plain and type(mine) not in plain and mask is not True:
                    return asked(mine, other, left, right)
            if type(left) is type(right) and type(left) in (list, tuple):
                return len(left) == len(right) and all(
                    a is b or equal(a, b, budget, (item(masks[0], i), item(masks[1], i)))
                    for i, (a, b) in enumerate(zip(left, right)))
            if type(left) is type(right) is dict:
                return left.keys() == right.keys() and all(
                    left[k] is right[k] or equal(left[k], right[k], budget,
                                                 (entry(masks[0], k), entry(masks[1], k)))
                    for k in left)
        return bool(left == right)

    def asserted(left, right, masks):
        """An assert's ``left == right`` (``masks``: where each side holds the test's own
        ``ANY``), after ``watchers`` (the namespace guard's check of the running test's
        module)."""
        for watch in watchers:
            watch()
        return equal(left, right, [10000], masks)

    return Built(asserted=asserted)


def parameters(fn_node, ast):
    """A function's parameters, those of them a ``parametrize`` decorator gives, and those
    whose values there write ``ANY``."""
    args = fn_node.args
    params = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    for extra in (args.vararg, args.kwarg):
        if extra is not None:
            params.add(extra.arg)
    given, given_any = set(), set()
    for deco in fn_node.decorator_list:
        if isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and \
                deco.func.attr == "parametrize" and deco.args and \
                isinstance(deco.args[0], ast.Constant) and isinstance(deco.args[0].value, str):
            names = {n.strip() for n in deco.args[0].value.split(",")}
            given |= names
            if any(isinstance(n, ast.Name) and n.id == "ANY" or isinstance(n, ast.Attribute)
                   and n.attr == "ANY" for a in deco.args[1:] for n in ast.walk(a)):
                given_any |= names
    return params, given, given_any


def binding_counts(root, ast, assigned=None):
    """How many times each name is bound under ``root`` (not counting ``root`` itself): a
    name bound by ``global``/``nonlocal``, ``except ... as`` or a nested def counts twice.
    ``assigned``: a list to add the single-name assignments (``x = ...``) to."""
    binds = {}
    for node in ast.walk(root):
        if node is root:
            continue
        if assigned is not None and isinstance(node, ast.Assign) and \
                len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds[node.name] = binds.get(node.name, 0) + 2
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            binds[node.id] = binds.get(node.id, 0) + 1
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for n in node.names:
                binds[n] = binds.get(n, 0) + 2
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                n = (alias.asname or alias.name).split(".")[0]
                binds[n] = binds.get(n, 0) + 1
        elif isinstance(node, ast.ExceptHandler) and node.name:
            binds[node.name] = binds.get(node.name, 0) + 2
    return binds


def file_bindings(source, ast):
    """What a test file's own top level binds, read from its source: the names bound once,
    by ``from ... import`` (not ``*``), as [(name, module, attribute, level)]; the
    undecorated ``def``s and ``class``es bound once, {name: kind}; and for each class, the
    names its body binds (defs, assignments, imports, in nested blocks too)."""
    tree = ast.parse(source)
    counts = binding_counts(tree, ast)
    imports = [(alias.asname or alias.name, node.module or "", alias.name, node.level)
               for node in tree.body if isinstance(node, ast.ImportFrom)
               for alias in node.names
               if alias.name != "*" and counts.get(alias.asname or alias.name) == 1]
    defs = {node.name: type(node).__name__ for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not node.decorator_list and counts.get(node.name) == 2}

    def body_names(body):
        names = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            else:
                names |= {n.id for t in getattr(node, "targets", [getattr(node, "target",
                                                                           None)])
                          if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        names |= body_names(inner)
        return names

    bodies = {node.name: body_names(node.body) for node in tree.body
              if isinstance(node, ast.ClassDef)}
    return imports, defs, bodies


def owned_sides(fn_node, ast):
    """For a test function's AST: ``mask(expr)``, where in an expression's value the test
    wrote ``ANY`` itself (in displays, through locals bound once, or as a ``parametrize``
    value): the only places whose object the equality probe leaves unasked."""
    params, given, given_any = set(), set(), set()
    if fn_node is None:  # module level: every name is the module's
        fn_node = ast.Module(body=[], type_ignores=[])
    else:
        params, given, given_any = parameters(fn_node, ast)
    binds = binding_counts(fn_node, ast, assigned := [])
    single = {node.targets[0].id: node.value for node in assigned
              if binds.get(node.targets[0].id) == 1}
    local = set(binds) | params

    def mask(expr, depth=0):
        """Where in ``expr``'s value the test wrote ``ANY``: True (the whole value), a
        ("s", masks) for a list or tuple display holding one, a ("d", ((key, mask), ...))
        for a dict display with constant keys holding one, else False."""
        if depth > 8:
            return False
        if isinstance(expr, ast.Name):
            if expr.id in local:
                if expr.id in given_any:  # parametrize's values write ANY
                    return True
                value = single.get(expr.id)
                return mask(value, depth + 1) if value is not None else False
            return expr.id == "ANY"  # the test module's (``from unittest.mock import ANY``)
        if isinstance(expr, ast.Attribute):  # mock.ANY, unittest.mock.ANY
            root = expr
            while isinstance(root, ast.Attribute):
                root = root.value
            return expr.attr == "ANY" and isinstance(root, ast.Name) and root.id not in local
        if isinstance(expr, (ast.List, ast.Tuple)):
            if any(isinstance(e, ast.Starred) for e in expr.elts):
                return False
            inner = tuple(mask(e, depth + 1) for e in expr.elts)
            return ("s", inner) if any(inner) else False
        if isinstance(expr, ast.Dict):
            if not all(isinstance(k, ast.Constant) for k in expr.keys):
                return False
            inner = tuple((k.value, mask(v, depth + 1)) for k, v in zip(expr.keys, expr.values))
            return ("d", inner) if any(m for _, m in inner) else False
        return False

    return mask


def instrument_asserts(t, probe, guard, equality, assert_equal, rewritten, kind="pytest"):
    """pytest's assertion rewriting and unittest's assertEqual, made to ask a probe: each
    ``==`` of an assert (its test, or a part of its and/or/not), ``a == b``, becomes
    ``audit(equality, a, b, own_a, own_b, box := []) or box[0]``, where ``audit`` is
    ``sys.audit`` itself, placed in the compiled code's constants (a code object's
    constants cannot be changed, and a function's code replaced is the hook's to see): the
    audit hook, which nothing can reach, judges it with a probe of its own and puts the
    answer in the fresh ``box``. Each ``x.assertEqual(a, b)`` of a test module becomes
    ``audit(assert_equal, x.assertEqual, a, b, own_a, own_b, rest, named)``, which the
    hook judges alike where it is unittest's (``probe``, reachable, serves an assertEqual
    called otherwise, and the runner's check covers it). pytest's cached rewritten bytecode
    is never read (it holds none of this). Returns what it installed and unittest's own
    assertEqual."""
    import ast
    import os
    import sys
    import unittest

    if kind == "pytest":
        import _pytest.assertion.rewrite as rewrite
    else:
        rewrite = None

    suffix = t.runner_name.strip("<>").rsplit("-", 1)[-1]
    box, marker = "_prorl_box_" + suffix, "<prorl-audit-" + suffix + ">"
    asserted, audit = probe.asserted, sys.audit
    if not guard:
        return Built(rewrite_module=rewrite)

    def located(made, where):
        """``made``, each node of it without a place at ``where``'s (the operands keep
        theirs)."""
        for node in ast.walk(made):
            if "lineno" in node._attributes and getattr(node, "lineno", None) is None:
                ast.copy_location(node, where)
        return made

    def index(n):
        number = ast.Constant(n)
        return ast.Index(value=number) if sys.version_info < (3, 9) else number

    def placed(node, where):
        """``node`` at ``where``'s place in the source (no tree-wide pass needed after)."""
        return ast.copy_location(node, where)

    def instrument(test, owned):
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and \
                isinstance(test.ops[0], ast.Eq):
            left, right = test.left, test.comparators[0]
            load, store = ast.Load(), ast.Store()
            call = ast.Call(
                func=ast.Subscript(value=ast.List(elts=[ast.Constant(marker)], ctx=load),
                                   slice=index(0), ctx=load),
                args=[ast.Constant(equality), left, right, ast.Constant(owned(left)),
                      ast.Constant(owned(right)),
                      ast.NamedExpr(target=ast.Name(id=box, ctx=store),
                                    value=ast.List(elts=[], ctx=load))], keywords=[])
            answer = ast.Subscript(value=ast.Name(id=box, ctx=load), slice=index(0),
                                   ctx=load)
            return located(ast.BoolOp(op=ast.Or(), values=[call, answer]), test)
        if isinstance(test, ast.BoolOp):
            test.values = [instrument(v, owned) for v in test.values]
        elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test.operand = instrument(test.operand, owned)
        return test

    def asserts_equal(call, owned):
        """``x.assertEqual(a, b, *rest, **named)`` made, in place, ``audit(assert_equal,
        x.assertEqual, a, b, owned(a), owned(b), (*rest,), {**named})`` (the same order of
        evaluation)."""
        if len(call.args) < 2 or any(isinstance(a, ast.Starred) for a in call.args[:2]):
            return
        first, second, *rest = call.args
        load = ast.Load()
        named = ast.Dict(keys=[None if k.arg is None else ast.Constant(k.arg)
                               for k in call.keywords],
                         values=[k.value for k in call.keywords])
        call.args = [ast.Constant(assert_equal), call.func, first, second,
                     ast.Constant(owned(first)), ast.Constant(owned(second)),
                     ast.Tuple(elts=rest, ctx=load), named]
        call.keywords = []
        call.func = ast.Subscript(value=ast.List(elts=[ast.Constant(marker)], ctx=load),
                                  slice=index(0), ctx=load)
        located(call, call)

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    blocks = ("body", "orelse", "finalbody", "handlers", "cases")
    assert_names = ("assertEqual", "assertEquals")

    def never_owned(expr):
        return False

    def instrument_module(mod, source):
        """The module's asserts, and its ``x.assertEqual(...)`` statements, found by a walk
        of its statements (not its expressions), each with the function it is in; a
        function's sides judged once, and only where the module writes ``ANY`` at all."""
        sites, stack = [], [(mod, None)]
        while stack:
            node, fn = stack.pop()
            kind = type(node)
            if kind is ast.Assert:
                sites.append((node, fn))
                continue
            if kind is ast.Expr:
                value = node.value
                if type(value) is ast.Call and type(value.func) is ast.Attribute and \
                        value.func.attr in assert_names:
                    sites.append((value, fn))
                continue
            if kind in functions:
                fn = node
            for field in blocks:
                inner = getattr(node, field, None)
                if type(inner) is list:
                    stack += [(child, fn) for child in inner]
        judge = not isinstance(source, bytes) or b"ANY" in source
        judged = {}
        for node, fn in sites:
            owned = judged.get(id(fn)) if judge else never_owned
            if owned is None:
                owned = judged[id(fn)] = owned_sides(fn, ast)
            if type(node) is ast.Assert:
                node.test = instrument(node.test, owned)
            else:
                asserts_equal(node, owned)

    code_type = type(index.__code__)

    def with_audit(co):
        """``co`` with ``marker`` in its constants (its own and its functions') made
        ``sys.audit``."""
        consts, changed = [], False
        for c in co.co_consts:
            if type(c) is str and c == marker:
                c, changed = audit, True
            elif type(c) is code_type:
                inner = with_audit(c)
                c, changed = inner, changed or inner is not c
            consts.append(c)
        return co.replace(co_consts=tuple(consts)) if changed else co

    installed = ()
    if rewrite is not None:
        pytests_run = rewrite.AssertionRewriter.run

        def run(self, mod):
            instrument_module(mod, getattr(self, "source", None))
            return pytests_run(self, mod)

        rewrite.AssertionRewriter.run = run
        pytests_rewrite_test = rewrite._rewrite_test

        def _rewrite_test(*args, **kwargs):
            made = pytests_rewrite_test(*args, **kwargs)
            if type(made) is tuple and len(made) == 2 and type(made[1]) is code_type:
                made = (made[0], with_audit(made[1]))
                audit(rewritten, made[1].co_filename, made[1])  # its frames' code, for the hook
            return made

        def _read_pyc(*args, **kwargs):
            return None  # rewritten here, every time, with the constant above

        rewrite._rewrite_test = _rewrite_test
        rewrite._read_pyc = _read_pyc
        installed = (run, _rewrite_test, _read_pyc)
    is_test_file, real_compile, parse = t.is_test_file, compile, ast.parse
    untrusted, repo = t.untrusted, t.repo

    def compile_test_file(source, filename, mode, *args, **kwargs):
        """A runner's ``compile`` of a test file (sympy's ``test_file`` compiles each test
        file's text itself): the file's own text, as it is on disk, with its asserts asked
        of the probe (any ``source`` given is not used: the code is always the file's).
        Anything else is compiled as asked, where its name is its maker's own."""
        plain = not args and all(k in ("flags", "dont_inherit") and not (
            k == "flags" and v) for k, v in kwargs.items())  # sympy 1.7: flags=0, ...
        if mode == "exec" and type(filename) is str and is_test_file(filename) and plain:
            with open(filename, "rb") as f:
                text = f.read()
            tree = parse(text, filename)
            instrument_module(tree, text)
            made = with_audit(real_compile(tree, filename, "exec", dont_inherit=True))
            audit(rewritten, filename, made)  # its frames' code, for the hook
            return made
        if type(filename) is str and not filename.startswith("<") and \
                not untrusted(os.path.normpath(os.path.join(repo, filename))):
            raise ValueError(f"the runner compiles no other trusted file ({filename})")
        return real_compile(source, filename, mode, *args, **kwargs)

    unittests_equal = unittest.TestCase.assertEqual

    compared = unittest_comparison(asserted, unittests_equal)

    def assertEqual(self, first, second, msg=None):
        compared(self, first, second, msg, (False, False))

    unittest.TestCase.assertEqual = assertEqual
    return Built(rewrite_module=rewrite, assert_equal=assertEqual,
                 unittests_equal=unittests_equal, installed=installed,
                 compile_test_file=compile_test_file)


def namespace_guard(t, asserts, emit, guard, kind="pytest"):
    """What must not change once collection is done: pytest, pluggy, unittest, signal,
    numpy.testing (where installed) and the builtins, as they were before any repository
    code ran; and each test module and its classes, as the module's own code left them
    (kept as soon as its body has run). A test module's attributes set by untrusted code
    are ``suspicious`` at once (its class is this guard's); any other change is found by
    ``tampered()``, which the plugin calls around every test and at every assert."""
    import ast
    import builtins
    import os
    import sys
    import types
    from operator import is_

    first_origin, getframe, repo, untrusted, path_of = t.first_origin, sys._getframe, \
        t.repo, t.untrusted, t.path_of
    rewrite_module = asserts.rewrite_module
    test_files = {os.path.realpath(os.path.join(repo, p)) for p in t.test_file_names}
    if kind == "pytest":
        import _pytest
        import _pytest.assertion.rewrite as rewrite
        import pluggy

        guarded_prefixes = ("_pytest", "pytest", "pluggy", "unittest", "signal", "_signal")
    else:  # the runner is the repository's (``runner_modules``), over unittest
        guarded_prefixes = ("unittest", "signal", "_signal")
    if not os.path.exists(os.path.join(repo, "numpy")):  # not when testing numpy itself
        try:
            import numpy.testing  # noqa: F401 - assert_allclose and friends
            guarded_prefixes += ("numpy.testing",)
        except ImportError:
            pass

    def kept(namespace):  # by type alone: a lazy object answers isinstance with its own
        return {k: v for k, v in namespace.items()
                if callable(v) or issubclass(type(v), (staticmethod, classmethod, property,
                                                       types.ModuleType))}

    snapshot = []  # (owner, {name: value}) for the runtime's modules and classes

    def keep_module(module):
        snapshot.append((module, kept(vars(module))))
        for value in list(vars(module).values()):
            if issubclass(type(value), type) and getattr(value, "__module__", "") == \
                    module.__name__:
                snapshot.append((value, kept(dict(vars(value)))))

    # -- the test modules -------------------------------------------------------------
    frozen = {}  # id(module) -> (module, {name: value}, [(class, {name: value})])

    def refuse(what, detail):
        emit("suspicious", event=what, detail=detail[:200])

    class Frozen(types.ModuleType):
        """A test module's class once its body has run: untrusted code may not set or
        delete its attributes; what trusted code sets (a test's ``mock.patch`` of its own
        module) is kept as the module's."""

        def __setattr__(self, name, value):
            where = first_origin(getframe(1))
            if where is not None:
                refuse("test module", f"{self.__name__}.{name} set by {where}")
            types.ModuleType.__setattr__(self, name, value)
            entry = frozen.get(id(self))
            if entry is not None:
                entry[1].pop(name, None)
                entry[1].update(kept({name: value}))

        def __delattr__(self, name):
            where = first_origin(getframe(1))
            if where is not None:
                refuse("test module", f"{self.__name__}.{name} deleted by {where}")
            types.ModuleType.__delattr__(self, name)
            entry = frozen.get(id(self))
            if entry is not None:
                entry[1].pop(name, None)

    def not_its_own(module):
        """Whether a test module is not what its own source made it, as its body has just
        run (a thread of the candidate's that acts while the body runs acts before the
        module is kept): a name bound once by ``from ... import`` that is not the attribute
        it imported; an undecorated top-level ``def`` or ``class`` that is not the file's;
        a class's ``assert*``/``fail*`` method that shadows a base's and that the class's
        body does not bind. The first such, or None."""
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or os.path.realpath(path) not in test_files:
            return None
        try:
            with open(path, "rb") as f:
                imports, defs, bodies = file_bindings(f.read(), ast)
        except (OSError, SyntaxError, ValueError):
            return None
        space, where = vars(module), os.path.normpath(os.path.join(repo, path))
        for name, source, attr, level in imports:
            full = source
            if level:
                package = (space.get("__package__") or "").split(".")
                package = package[:len(package) - level + 1] if level > 1 else package
                full = ".".join([p for p in package if p] + ([source] if source else []))
            theirs = getattr(sys.modules.get(full), "__dict__", None)
            if type(theirs) is not dict:
                continue
            expected = theirs.get(attr, sys.modules.get(f"{full}.{attr}"))
            if expected is not None and space.get(name) is not expected:
                return f"{module.__name__}.{name} is not the {full}.{attr} it imported"
        for name, kind in defs.items():
            value = space.get(name)
            if kind == "ClassDef":
                ours = isinstance(value, type) and value.__dict__.get("__module__") == \
                    module.__name__ and type.__getattribute__(value, "__qualname__") == name
            else:
                code = getattr(value, "__code__", None)
                ours = type(value) is types.FunctionType and code.co_name == name and \
                    path_of(code) == where
            if not ours:
                return f"{module.__name__}.{name} is not the {kind} its file defines"
            if kind == "ClassDef":
                mro = type.__getattribute__(value, "__mro__")
                for key in vars(value):
                    if key.startswith(("assert", "fail")) and key not in bodies.get(name, ()) \
                            and any(key in vars(base) for base in mro[1:]):
                        return f"{module.__name__}.{name}.{key} is not its class body's"
        return None

    def freeze(module):
        """Keep a test module as its own code left it, and make its class the guard's (not
        a module of the candidate's own code, which pytest may collect tests from too: what
        it does to itself is its own business)."""
        if id(module) in frozen:
            return
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or untrusted(os.path.normpath(os.path.join(repo, path))):
            return
        if type(module) is not types.ModuleType:
            refuse("test module", f"{module.__name__}: its class is "
                                  f"{type(module).__name__}, not a module's")
        why = not_its_own(module)
        if why is not None:
            refuse("test module", why)
        classes = [(v, kept(dict(vars(v))), set(vars(v))) for v in list(vars(module).values())
                   if isinstance(v, type) and getattr(v, "__module__", "") == module.__name__]
        frozen[id(module)] = (module, kept(vars(module)), classes)
        module.__class__ = Frozen

    def is_test_module(module):
        path = getattr(module, "__file__", None)
        return isinstance(path, str) and os.path.realpath(path) in test_files

    if guard:
        if kind == "pytest":
            hook_class = rewrite.AssertionRewritingHook
        else:  # Django's test modules, imported by unittest's loader
            from importlib.machinery import SourceFileLoader as hook_class
        loaders_exec = hook_class.exec_module

        def exec_module(self, module):
            loaders_exec(self, module)
            if is_test_module(module):
                freeze(module)

        hook_class.exec_module = exec_module

    every = object()
    data_set_by_runner = kind != "pytest"

    def test_module_changed(module, only=every):
        """How a frozen test module, or one of its classes (``only``: that class alone, or
        None for none), differs from what was kept, or None."""
        entry = frozen.get(id(module))
        if entry is None:
            return None
        _, saved, classes = entry
        if type(module) is not Frozen:
            return f"{module.__name__}: its class replaced"
        current = vars(module)
        if current.get("@py_builtins", builtins) is not builtins or current.get(
                "@pytest_ar", rewrite_module) is not rewrite_module:
            return f"{module.__name__}: its assertion helpers replaced"
        # The common case (nothing changed) in C: this runs at every assert.
        if not all(map(is_, map(current.get, saved.keys()), saved.values())):
            for key, value in saved.items():
                if current.get(key) is not value:
                    return f"{module.__name__}.{key} rebound"
        for cls, attrs, keys in classes:
            if only is not every and cls is not only:
                continue
            now = vars(cls)
            if not all(map(is_, map(now.get, attrs.keys()), attrs.values())):
                for key, value in attrs.items():
                    if now.get(key) is not value:
                        return f"{module.__name__}.{cls.__name__}.{key} replaced"
            added = now.keys() - keys
            for key in added:  # a base's method shadowed since
                if data_set_by_runner and not kept({key: now[key]}):
                    continue  # unittest's and Django's runners set data on test classes
                if any(key in vars(base) for base in type.__getattribute__(cls, "__mro__")[1:]):
                    return f"{module.__name__}.{cls.__name__}.{key} overridden"
            keys |= added  # set since, shadowing nothing (a class's own data)
        return None

    # -- the runtime ------------------------------------------------------------------
    guarded = {name: module for name, module in sys.modules.items()
               if name.startswith(guarded_prefixes)}
    snapshot.append((builtins, kept(vars(builtins))))
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
                         "startdir", "fspath", "makedir"} if kind == "pytest" else set()
    pytest_dirs = tuple({os.path.dirname(q(m.__file__)) + os.sep for m in (_pytest, pluggy)
                         for q in (os.path.normpath, os.path.realpath)}) \
        if kind == "pytest" else ("//",)
    path_of = t.path_of

    def pytests_own(value):
        function = value.fget if isinstance(value, property) else value
        code = getattr(function, "__code__", None)
        return code is not None and path_of(code).startswith(pytest_dirs)

    def tampered(running=None):
        """What changed of the runtime and the test modules, or None; ``running``: only the
        running test's (module, class), checked at each of its asserts."""
        if running is not None:
            return test_module_changed(*running)
        for name, module in guarded.items():
            if sys.modules.get(name) is not module:
                return f"sys.modules[{name!r}] replaced"
        why = next(filter(None, (test_module_changed(m) for m, _, _ in frozen.values())),
                   None)
        if why is not None:
            return why
        for owner, saved in snapshot:
            current = vars(owner)
            for key, value in saved.items():
                now = current.get(key)
                if now is not value and not (key in patched_by_pytest and pytests_own(now)) \
                        and not (id(owner) in runners_own and trusted_function(now)):
                    return f"{getattr(owner, '__name__', owner)}.{key} replaced"
        return None

    # A repository's runner sets its own parts up (Django's runtests.py sets its suite's
    # process_setup): a change in a runner module is the runner's if the new value is a
    # function of trusted code (the candidate's own is found, and found on the stack).
    runners_own = set()

    def trusted_function(value):
        kind = type(value)
        inner = value.__func__ if kind in (staticmethod, classmethod) else value
        code = inner.__code__ if type(inner).__name__ == "function" else None
        return code is not None and not path_of(code).startswith("<") and \
            not untrusted(path_of(code))

    def keep_modules(modules):
        """A repository's own runner modules (imported after the snapshot: they import the
        repository), kept as they are now."""
        for module in modules:
            guarded[module.__name__] = module
            start = len(snapshot)
            keep_module(module)
            runners_own.update(id(owner) for owner, _ in snapshot[start:])

    return Built(keep_late=keep_late, tampered=tampered, freeze=freeze,
                 keep_modules=keep_modules)


def evidence_plugin(request, emit, ids, guard_of, watchers, guard):
    """The pytest plugin that sends the evidence, test by test, and checks, around every
    test and at each of its asserts, that nothing was tampered with."""

    import pytest

    foreign_test, foreign_hooks, foreign_fixtures = ids.foreign_test, ids.foreign_hooks, \
        ids.foreign_fixtures
    tampered, keep_late, freeze = guard_of.tampered, guard_of.keep_late, guard_of.freeze
    wanted = set(request["tests"])
    every_test = bool(request.get("every_test"))
    returned = {}  # nodeid -> whether its call returned (seen by our own wrapper)
    running = []  # (module, class) of the test whose call is running

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

    def at_assert():
        """Before an assert's ==: the running test's module and classes as they were."""
        why = tampered(running[0]) if guard and running else None
        if why is not None:
            emit("suspicious", event="assert", detail=why)

    watchers.append(at_assert)

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
            if guard:  # the modules pytest did not rewrite: as they are now
                for item in session.items:
                    module = getattr(item, "module", None)
                    if module is not None:
                        freeze(module)
            check("collected", session=session)
            emit("collected", tests=[i.nodeid for i in session.items])

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            check("before call", item)
            module = getattr(item, "module", None)
            running[:] = [(module, getattr(item, "cls", None))] if module is not None else []
            outcome = yield
            running[:] = []
            check("after call", item)
            returned[item.nodeid] = outcome.excinfo is None

        def pytest_runtest_logreport(self, report):
            if report.nodeid not in wanted:
                return
            check("report")
            emit("report", test=report.nodeid, when=report.when, outcome=report.outcome,
                 returned=returned.get(report.nodeid, False) if report.when == "call"
                 else None, xfail=hasattr(report, "wasxfail"))

    return Built(plugin=Evidence(), check=check)


def foreign_code(untrusted, path_of):
    """``foreign(module)``: the first function of ``module`` or of a class it defines (its
    methods, static and class methods, properties) whose code is untrusted (the candidate's
    code put in the runner's place), as ``module.name``; or None. The runner is the
    repository's own code (sympy's ``runtests``, Django's ``django.test``): trusted by its
    content, and held to hold nothing of the candidate's."""

    def functions(owner):
        for name, value in list(vars(owner).items()):
            kind = type(value)
            inner = value.__func__ if kind in (staticmethod, classmethod) else \
                value.fget if kind is property else value
            code = inner.__code__ if type(inner).__name__ == "function" else None
            if code is not None:
                yield name, code

    def foreign(module):
        owners = [module] + [v for v in list(vars(module).values())
                             if issubclass(type(v), type)
                             and getattr(v, "__module__", None) == module.__name__]
        for owner in owners:
            for name, code in functions(owner):
                path = path_of(code)
                # Code from a string (a namedtuple's __new__) is its maker's, and found on
                # the stack if it ever runs in the runner's place: a file's is found here.
                if not path.startswith("<") and untrusted(path):
                    return f"{getattr(owner, '__name__', owner)}.{name} is {path}'s"
        return None

    return foreign


def sympy_evidence(request, t, emit, asserts, guard, checks):
    """sympy's own runner (``bin/test``'s ``sympy.test``, in this process, its output the
    log), sending a record per test from its reporter: the reporter's methods, wrapped on
    its class, say what the runner decided of each test function (``test_pass`` only where
    the function returned), and the runner compiles each test file through the probe's
    ``compile`` (its asserts asked of the probe). Returns the runner's modules (the guard
    keeps them) and ``run()``: the exit status ``bin/test`` would end with."""
    import importlib
    import os
    import sys
    import warnings

    repo = t.repo
    current = []  # the test function the runner is in, until its result
    original, modules = {}, []
    outcome_of = {"test_pass": "passed", "test_fail": "failed", "test_exception": "error",
                  "test_skip": "skipped", "test_xfail": "xfail", "test_xpass": "xpass"}

    def entering_filename(self, *args, **kwargs):
        current[:] = []
        return original["entering_filename"](self, *args, **kwargs)

    def entering_test(self, f):
        current[:] = [getattr(f, "__name__", "?")]
        return original["entering_test"](self, f)

    def made(name):
        def said(self, *args, **kwargs):
            for check in checks:
                check("result")
            if current:  # a test's result (not a test file's own error)
                emit("result", test=current.pop(), outcome=outcome_of[name])
            return original[name](self, *args, **kwargs)
        said.__name__ = name
        return said

    def load():
        """Import the runner (the repository's code runs from here) and wrap its reporter;
        returns the runner's modules."""
        # bin/test -C: no cache; the spec's PYTHONWARNINGS; run from the repository's root
        # with it first on the path, as bin/test's path_hack puts it.
        os.environ["SYMPY_USE_CACHE"] = "no"
        for category in (UserWarning, SyntaxWarning):
            warnings.filterwarnings("ignore", category=category)
        os.chdir(repo)
        sys.path.insert(0, repo)
        for name in ("sympy.testing.runtests", "sympy.utilities.runtests"):
            try:
                runtests = importlib.import_module(name)
                break
            except ImportError:
                continue
        else:
            raise RuntimeError("no sympy.testing.runtests or sympy.utilities.runtests")
        helpers = [m for m in (sys.modules.get("sympy.testing.pytest"),
                               sys.modules.get("sympy.utilities.pytest")) if m is not None]
        reporter = runtests.PyTestReporter
        original.update({name: vars(reporter)[name] for name in (
            "entering_filename", "entering_test", *outcome_of)})
        reporter.entering_filename = entering_filename
        reporter.entering_test = entering_test
        for name in outcome_of:
            setattr(reporter, name, made(name))
        if guard:
            runtests.compile = asserts.compile_test_file
        modules[:] = [runtests, *helpers]
        return modules

    def run():
        files = request["files"]
        ok = modules[0].test(*files, verbose=True, subprocess=False) if files else True
        return 0 if ok else 1

    return Built(load=load, run=run, installed=(entering_filename, entering_test),
                 modules=modules)


def django_evidence(request, t, emit, guard, checks):
    """Django's own runner (``tests/runtests.py`` with SWE-bench's options, in this
    process, its output the log), sending a record per test from unittest's verbose result
    (the class ``runtests.py``'s runner reports to): each test by the name its log line
    shows (a docstring's first line where the test has one), with whether this runner's own
    wrapper of the test method's call saw it return. Returns the runner's modules and
    ``run()``: the exit status of ``runtests.py``."""
    import importlib
    import importlib.util
    import os
    import sys
    import traceback
    import unittest.case
    import unittest.runner

    repo = t.repo
    script = os.path.join(repo, "tests", "runtests.py")
    result_class, case = unittest.runner.TextTestResult, unittest.case.TestCase
    returned = set()  # id() of the tests whose method returned
    calls = case._callTestMethod
    original = {name: vars(result_class)[name] for name in (
        "addSuccess", "addError", "addFailure", "addSkip", "addExpectedFailure",
        "addUnexpectedSuccess")}
    outcome_of = {"addSuccess": "passed", "addError": "error", "addFailure": "failed",
                  "addSkip": "skipped", "addExpectedFailure": "xfail",
                  "addUnexpectedSuccess": "xpass"}
    getdescription = result_class.getDescription

    def _callTestMethod(self, method):
        calls(self, method)
        returned.add(id(self))

    def made(name):
        def said(self, test, *args, **kwargs):
            for check in checks:
                check("result")
            lines = str(getdescription(self, test)).splitlines() or [str(test)]
            emit("result", test=lines[-1], outcome=outcome_of[name],
                 returned=id(test) in returned)
            return original[name](self, test, *args, **kwargs)
        said.__name__ = name
        return said

    case._callTestMethod = _callTestMethod
    for name in outcome_of:
        setattr(result_class, name, made(name))
    modules = []

    def load():
        """The runner's modules, as runtests.py's first lines import them (the repository's
        code runs from here), so that they are kept before the run."""
        os.chdir(repo)
        sys.path.insert(0, os.path.dirname(script))  # as `python tests/runtests.py` has it
        modules[:] = [importlib.import_module(f"django.test.{name}")
                      for name in ("runner", "testcases", "utils")]
        return modules

    def run():
        files = request["files"]
        if not files:
            return 0
        sys.argv = [script, *request.get("runner_args", []), *files]
        spec = importlib.util.spec_from_file_location("__main__", script)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except SystemExit as e:
            return e.code if type(e.code) is int else 0 if e.code is None else 1
        except BaseException:  # noqa: BLE001 - what the tests raise is theirs
            traceback.print_exc()
            return -1
        return 0

    return Built(load=load, run=run, installed=(_callTestMethod,), modules=modules)


def runner_evidence(own, guard_of, emit, guard, t):
    """For a repository's own runner (sympy's, Django's): the checks around it. The
    runner's modules hold nothing of the candidate's when they are kept, and at each record
    (its wrappers run ``check`` before each) nothing of the runtime, the runner's modules
    or the test modules has changed since (the guard's ``tampered``)."""
    foreign = foreign_code(t.untrusted, t.path_of)
    tampered = guard_of.tampered
    if guard:
        why = next(filter(None, map(foreign, own.modules)), None)
        if why is not None:
            emit("suspicious", event="runner", detail=why)
        guard_of.keep_modules(own.modules)

    def check(where):
        if not guard:
            return
        why = tampered()
        if why is not None:
            emit("suspicious", event=where, detail=why)

    def run():
        check("start")
        return own.run()

    return Built(check=check, run=run)


def run_tests(request, plugin):
    """pytest on the request's files, from the repository's root; its exit code."""
    import os
    import sys

    import pytest

    files = request["files"]
    # The environment's own plugins (installed by the farm, named by it): autoloading
    # stays off, so nothing the candidate registers as an entry point is loaded.
    options = [a for m in request.get("plugins", []) for a in ("-p", m)]
    options += request.get("pytest_args", ["-q"])
    repo = os.path.realpath(os.path.normpath(request["repo"]))
    os.chdir(repo)
    sys.path.insert(0, repo)  # as `python -m pytest` from the repository's root would
    if not files:
        return 0
    try:
        return int(pytest.main(["-p", "no:cacheprovider", "--rootdir", repo, *options,
                                *files], plugins=[plugin]))
    except BaseException:  # noqa: BLE001 - what the tests raise is theirs
        import traceback

        traceback.print_exc()  # into the output the verdict keeps
        return -1


def runner_state(roots, namespaces, fixed):
    """A check of the runner as built: every function reachable from ``roots`` through
    closures, lists, tuples and ``Built`` objects keeps its code, defaults and closure
    contents (a class of the runner's, its methods); each ``(mapping, items, closed)`` of
    ``namespaces`` (the runner's globals, its copy of the builtins, the asserts' helpers in
    the builtins) keeps those items and, where ``closed``, gains no other name; each list
    of ``fixed`` (the checks at each assert) its items. Returns ``check()``: what changed,
    or None. Handed to the audit hook, which runs it before sending any record and at each
    assert's ==: a closure cell or a global of the runner that the tests rebind (they can
    reach the runner's functions: a helper of the asserts is a builtin) is found there."""
    function, mine = type(runner_state), runner_state.__module__
    functions, seen, todo = [], set(), list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if type(obj) in (list, tuple):
            todo.extend(obj)
        elif type(obj) is Built:
            todo.extend(vars(obj).values())
        elif isinstance(obj, type) and obj.__module__ == mine:  # a class of the runner's
            todo.extend(getattr(v, "__func__", v) for v in vars(obj).values())
        elif type(obj).__module__ == mine:
            todo.append(type(obj))  # an instance of one (the plugin)
        elif type(obj) is function:
            cells = obj.__closure__ or ()
            contents = []
            for cell in cells:
                try:
                    contents.append(cell.cell_contents)
                except ValueError:  # not bound yet
                    contents.append(cell)
            todo.extend(contents)
            functions.append((obj, obj.__code__, obj.__defaults__,
                              dict(obj.__kwdefaults__ or {}), cells, tuple(contents)))
    kept = [(mapping, dict(items), closed) for mapping, items, closed in namespaces]
    lists = [(each, tuple(each)) for each in fixed]

    def check():
        for fn, code, defaults, kwdefaults, cells, contents in functions:
            if fn.__code__ is not code or fn.__defaults__ is not defaults or \
                    dict(fn.__kwdefaults__ or {}) != kwdefaults:
                return f"the runner's {fn.__qualname__} was changed"
            for cell, was in zip(cells, contents):
                try:
                    now = cell.cell_contents
                except ValueError:
                    now = cell
                if now is not was:
                    return f"a closure of the runner's {fn.__qualname__} was rebound"
        for mapping, items, closed in kept:
            for name, value in items.items():
                if mapping.get(name, mapping) is not value:
                    return f"the runner's {name} was rebound"
            if closed and len(mapping) != len(items):
                extra = [k for k in mapping if k not in items and k != "__warningregistry__"]
                if extra:
                    return f"{extra[0]} was added to the runner's names"
        for each, items in lists:
            if tuple(each) != items:
                return "the runner's checks at each assert were changed"
        return None

    return check


def main():
    import os
    import sys

    request = read_request()
    # Off where the repository under test is the test runner itself (pytest's own tests):
    # its code is the candidate's, and what it does to run tests (read test files, walk
    # frames) is what the hook forbids. The harness says so in the verdict.
    guard = request.get("guard", True)
    channel = evidence_channel(request, guard)
    emit, equality, assert_equal, rewritten = channel.emit, channel.equality, \
        channel.assert_equal, channel.rewritten
    t = trust(request)
    watchers = []
    if guard:
        hooked = audit_hook(t, channel, watchers)
        sys.addaudithook(hooked.hook)
    del channel
    import_the_runner(request)
    kind = request.get("kind", "pytest")
    signals = signal_guard(t, emit, guard)
    probe = equality_probe(emit, watchers)
    asserts = instrument_asserts(t, probe, guard, equality, assert_equal, rewritten, kind)
    if kind == "pytest":
        ids = identity(t, request)
        guard_of = namespace_guard(t, asserts, emit, guard)
        evidence = evidence_plugin(request, emit, ids, guard_of, watchers, guard)
    else:  # the runtime (with unittest's wrappers) kept before the runner is imported
        ids = None
        checks = []  # the runner's check, run by its wrappers before each record
        own = sympy_evidence(request, t, emit, asserts, guard, checks) if kind == "sympy" \
            else django_evidence(request, t, emit, guard, checks)
        guard_of = namespace_guard(t, asserts, emit, guard, kind)
        own.load()
        evidence = runner_evidence(own, guard_of, emit, guard, t)
        checks.append(evidence.check)
    if guard:
        mine = main.__globals__
        check = runner_state(
            [emit, t, signals, ids, probe, asserts, guard_of, evidence, tuple(watchers),
             tuple(mine.values())],
            [(mine, mine, True), (mine["__builtins__"], mine["__builtins__"], True)],
            [watchers] if kind == "pytest" else [watchers, checks])
        hooked.seal(Built(check=check, assert_equal=asserts.assert_equal,
                          unittests_equal=asserts.unittests_equal,
                          compile_code=asserts.compile_test_file.__code__))
        del hooked, check
    code = run_tests(request, evidence.plugin) if kind == "pytest" else evidence.run()
    evidence.check("end")
    emit("done", exit_code=code)
    for stream in (sys.__stdout__, sys.__stderr__):  # the log's last lines (the summary)
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - the log is for reading, the evidence is sent
            pass
    os._exit(0)  # no atexit hook of the repository's runs after the evidence


main()
