"""The program's side of call-style tests (HumanEval, MBPP): runs in the jail as
``python3 -I -c <this text + "main()"> [--confine WORDS...] ENTRY FD`` (or imported, in a
warm grader, and its ``main`` called), confines itself (confine.py's
``confined_args``: the jail's first stage, without a second interpreter), loads
``solution.py`` into a namespace of its own, says
what its top-level names are, then answers the harness's requests (one JSON line each on
stdin) with one JSON line each on descriptor FD.

Nothing here is trusted: the program can replace any of it. What it sends is read by the
harness as a description of a value (:mod:`values`), rebuilt from trusted types; a value
without one is a reference to an entry of ``TABLE``, reached only by asking here again.

Requests: ``["call", id, args, kwargs]`` (the result, and the new state of every mutable
argument the call changed, as the test may read it after the call); ``["op", name, id,
args]`` (one of ``OPS``: comparisons between the program's own objects, length, truth,
items, attributes, iteration); ``["next", id, n]`` (up to n items of an iterator).
Answers: ``["ok", value, ...]``, ``["raise", type name, built-in base, message, id]``, or
``["fail", why]`` before ``["ready", names]`` if the program does not load.
"""

import operator
import os
import sys
import types

# include: values.py
# include: confine.py

ITER_BATCH = 1024  # at most this many items per "next"
OPS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
       "gt": operator.gt, "ge": operator.ge, "hash": hash, "len": len, "bool": bool,
       "str": str, "repr": repr, "getitem": operator.getitem, "contains": operator.contains,
       "getattr": getattr, "iter": iter, "isinstance": isinstance, "setattr": setattr,
       "setitem": operator.setitem, "delitem": operator.delitem}
MUTABLE = (list, dict, set, bytearray, collections.deque)  # noqa: F821 - values.py's import
TABLE = []
IDS = {}


def kind(obj):
    if isinstance(obj, type):
        return "class"
    if hasattr(type(obj), "__next__") and hasattr(type(obj), "__iter__"):
        return "iterator"
    return "function" if callable(obj) else "object"


def ref(obj):
    key = id(obj)
    if key not in IDS:
        IDS[key] = len(TABLE)
        TABLE.append(obj)
    named = obj if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) \
        else type(obj)
    return ["R", IDS[key], kind(obj), str(getattr(named, "__name__", "object"))[:100]]


def resolve(index, _kind, _name):
    if not 0 <= index < len(TABLE):
        raise Malformed("no such reference")  # noqa: F821 - values.py's
    return TABLE[index]


def builtin_base(cls):
    for base in cls.__mro__:
        if base.__module__ == "builtins":
            return base.__name__
    return "BaseException"


def raised(error):
    try:
        message = str(error)[:500]
    except BaseException:  # noqa: BLE001 - its __str__ is the program's
        message = ""
    cls = type(error)
    own = None if cls.__module__ == "builtins" else ref(cls)[1]
    return ["raise", cls.__name__[:100], builtin_base(cls), message, own]


def main():
    # In the jail: confined before anything of the program runs.
    entry, fd = confined_args(sys.argv[1:])  # noqa: F821 - confine.py's
    out = os.fdopen(int(fd), "w")

    def send(message):
        out.write(line_of(message) + "\n")  # noqa: F821 - values.py's
        out.flush()

    ns = {"__name__": "solution"}
    try:
        with open("solution.py") as f:
            exec(compile(f.read(), "solution.py", "exec"), ns)
        ns[entry]
    except BaseException as e:  # noqa: BLE001
        send(["fail", type(e).__name__])
        raise SystemExit(1) from None
    names = {}
    for name, value in list(ns.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            names[name] = ["module", str(getattr(value, "__name__", ""))]
        elif isinstance(value, type):
            base = builtin_base(value) if issubclass(value, BaseException) else None
            names[name] = ["class", ref(value)[1], base]
        elif callable(value):
            names[name] = ["function", ref(value)[1]]
        else:
            try:
                names[name] = ["value", encode(value)]  # noqa: F821 - values.py's
            except (Unencodable, RecursionError):  # noqa: F821
                pass
    send(["ready", names])
    for line in sys.stdin:
        try:
            request = read_line(line)  # noqa: F821 - values.py's
            op = request[0]
            if op == "call":
                target = resolve(request[1], None, None)
                args = [decode(a, resolve) for a in request[2]]  # noqa: F821
                kwargs = {k: decode(v, resolve) for k, v in request[3].items()}  # noqa: F821
                before = {key: dumps(v, ref) for key, v in  # noqa: F821
                          [*enumerate(args), *kwargs.items()] if isinstance(v, MUTABLE)}
                value = target(*args, **kwargs)
                changed = []
                for key, v in [*enumerate(args), *kwargs.items()]:
                    if key in before:
                        now = encode(v, ref)  # noqa: F821
                        if line_of(now) != before[key]:  # noqa: F821
                            changed.append([key, now])
                send(["ok", encode(value, ref), changed])  # noqa: F821
            elif op == "op" and request[1] in OPS:
                args = [decode(a, resolve) for a in request[3]]  # noqa: F821
                value = OPS[request[1]](resolve(request[2], None, None), *args)
                send(["ok", encode(value, ref)])  # noqa: F821
            elif op == "next":
                it = resolve(request[1], None, None)
                items, done = [], False
                for _ in range(max(1, min(int(request[2]), ITER_BATCH))):
                    try:
                        items.append(next(it))
                    except StopIteration:
                        done = True
                        break
                send(["ok", ["L", *(encode(v, ref) for v in items)], done])  # noqa: F821
            else:
                send(["raise", "TypeError", "TypeError", "an unknown request", None])
        except BaseException as e:  # noqa: BLE001 - the harness decides what it means
            send(raised(e))
