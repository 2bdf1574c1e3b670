"""Python values across the jail's pipe as typed descriptions: JSON, with every value that
is not a JSON one written as a list whose first item names its type. Shared by the code
harness (which encodes the test's arguments and rebuilds the program's results from trusted
types only) and by the call server in the jail (which encodes what the program returns).

Standard library only: both sides run with nothing importable beside them (``python3 -I``).
And little of it at start: the jail's side starts once per program, so ``json`` (which
imports ``re``), ``decimal``, ``fractions`` and ``base64`` are not imported until a value
needs them (a program's Decimal means its ``decimal`` is loaded); lines are written and read
by ``json``'s own C accelerator.

A description never carries code. What has no description (an instance of the program's
own class, a function it returns, an open iterator) is a *reference*: ``["R", id, kind,
name]``, an entry of the server's table that the harness reaches by asking the server.

- None, bool, str, an int within 2**53, a finite float: itself;
- a larger int: ``["i", hex]`` (no digit limit: hex is linear both ways);
- inf, -inf, nan: ``["f", "inf"]`` ...;
- list, tuple, set, frozenset: ``["L", *items]``, ``["T", ...]``, ``["S", ...]``,
  ``["F", ...]``; dict: ``["D", k1, v1, k2, v2, ...]``;
- complex, bytes, bytearray: ``["c", re, im]``, ``["b", base64]``, ``["B", base64]``;
- Decimal, Fraction: ``["dec", text]``, ``["fr", num, den]``;
- Counter, OrderedDict, defaultdict, deque: ``["Counter", k, v, ...]``, ``["OD", ...]``,
  ``["dd", factory, k, v, ...]``, ``["dq", maxlen, *items]``;
- range and dict views: ``["range", start, stop, step]``, ``["K", ...]``, ``["V", ...]``,
  ``["I", k, v, ...]``; a namedtuple: ``["N", typename, [fields], *items]``;
- a built-in type or function of values (``int``, ``len``; ``BUILTINS``):
  ``["builtin", name]``;
- a subclass of the built-in types above: its built-in value (``class Liar(int)`` is its
  int, whatever its ``__eq__`` says).
"""

import builtins
import collections
import math
import sys

try:
    import _json  # json's C accelerator, without json's import of re (a fifth of a start)
except ImportError:  # pragma: no cover - an interpreter without it
    _json = None

JSON_INT = 2 ** 53
# The built-ins that may cross by name: types and functions of values only. Never eval,
# exec, compile, open, __import__, getattr or another that reaches beyond its arguments: a
# program's result the test calls runs in the harness.
BUILTINS = frozenset(
    "int float str bool list tuple dict set frozenset bytes bytearray complex object range "
    "slice len abs min max sum sorted reversed enumerate zip map filter any all round pow "
    "divmod ord chr bin hex oct repr ascii format hash isinstance issubclass callable iter "
    "next".split()) | frozenset(n for n in dir(builtins) if isinstance(
        getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException))
_FACTORIES = {"int": int, "float": float, "str": str, "list": list, "set": set, "dict": dict,
              "tuple": tuple, "frozenset": frozenset, "bool": bool, "complex": complex,
              "bytes": bytes}
_SEQUENCES = {"L": list, "T": tuple, "S": set, "F": frozenset}
_SEQUENCE_TAGS = {cls: tag for tag, cls in _SEQUENCES.items()}


def _loaded(module, name):
    """``module.name`` if ``module`` is loaded, else None: a value of that type cannot exist
    before its module is."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def _module(name):
    return __import__(name)


class Unencodable(TypeError):
    """A value with no description and no table to refer to it by."""


def _int(value):
    return value if -JSON_INT < value < JSON_INT else ["i", format(value, "x")]


def _float(value):
    if math.isfinite(value):
        return value
    return ["f", "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")]


def _pairs(items, enc):
    out = []
    for k, v in items:
        out.append(enc(k))
        out.append(enc(v))
    return out


def encode(value, ref=None):
    """The description of ``value``; ``ref(value)`` -> ``["R", ...]`` for what has none
    (None: such a value raises :class:`Unencodable`)."""
    def enc(v):
        return encode(v, ref)

    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return _int(value)
    if t is float:
        return _float(value)
    if t in _SEQUENCE_TAGS:
        return [_SEQUENCE_TAGS[t], *map(enc, value)]
    if t is dict:
        return ["D", *_pairs(value.items(), enc)]
    if t is collections.Counter:
        return ["Counter", *_pairs(dict.items(value), enc)]
    if t is collections.OrderedDict:
        return ["OD", *_pairs(dict.items(value), enc)]
    if t is collections.defaultdict:
        factory = value.default_factory
        name = factory.__name__ if factory in _FACTORIES.values() else None
        return ["dd", name, *_pairs(dict.items(value), enc)]
    if t is collections.deque:
        return ["dq", value.maxlen, *map(enc, value)]
    if t is complex:
        return ["c", _float(value.real), _float(value.imag)]
    if t is bytes:
        return ["b", _module("base64").b64encode(value).decode()]
    if t is bytearray:
        return ["B", _module("base64").b64encode(bytes(value)).decode()]
    if t is _loaded("decimal", "Decimal"):
        return ["dec", str(value)]
    if t is _loaded("fractions", "Fraction"):
        return ["fr", _int(value.numerator), _int(value.denominator)]
    if t is range:
        return ["range", _int(value.start), _int(value.stop), _int(value.step)]
    if isinstance(value, (type, type(len))) and getattr(value, "__name__", "") in BUILTINS \
            and getattr(builtins, value.__name__) is value:
        return ["builtin", value.__name__]  # int, len...: by name, the same on either side
    if t is type({}.keys()):
        return ["K", *map(enc, value)]
    if t is type({}.values()):
        return ["V", *map(enc, value)]
    if t is type({}.items()):
        return ["I", *_pairs(value, enc)]
    if isinstance(value, tuple) and isinstance(getattr(t, "_fields", None), tuple):
        return ["N", t.__name__, [str(f) for f in t._fields], *map(enc, tuple.__iter__(value))]
    # A subclass of a built-in type is its built-in value (its own methods are not asked).
    if isinstance(value, int):  # bool is final: a subclass of int here is not one
        return _int(int.__int__(value))
    if isinstance(value, float):
        return _float(float.__float__(value))
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, dict):
        return ["D", *_pairs(dict.items(value), enc)]
    for base in _SEQUENCES.values():
        if isinstance(value, base):
            return encode(base(base.__iter__(value)), ref)
    for base in (bytes, bytearray, complex, _loaded("decimal", "Decimal"),
                 _loaded("fractions", "Fraction")):
        if base is not None and isinstance(value, base):
            return encode(base(value), ref)
    if type(value).__module__ == "numpy" and hasattr(value, "item") and \
            getattr(value, "shape", None) == ():
        return encode(value.item(), ref)
    if ref is None:
        raise Unencodable(f"a {t.__name__} cannot be carried to the program")
    return ref(value)


def _unjsonable(value):
    raise TypeError(f"a {type(value).__name__} is not a description")


def _not_a_number(name):
    raise ValueError(f"{name} is not a description")


if _json is not None:
    # json.dumps(message, separators=(",", ":"), allow_nan=False), by the same C encoder
    _ENCODER = _json.make_encoder(None, _unjsonable, _json.encode_basestring_ascii, None,
                                  ":", ",", False, False, False)

    class _Strict:  # what json.loads's scanner reads of its decoder
        strict, object_hook, object_pairs_hook = True, None, None
        parse_float, parse_int, parse_constant = float, int, staticmethod(_not_a_number)
        memo = {}

    _SCAN = _json.make_scanner(_Strict())


def line_of(message):
    """A description (or a message of them) as the one line each side writes."""
    if _json is None:
        return _module("json").dumps(message, separators=(",", ":"), allow_nan=False)
    return "".join(_ENCODER(message, 0))


def read_line(line):
    """The message of one line (what ``json.loads`` reads: one JSON value)."""
    if _json is None:
        return _module("json").loads(line)
    _Strict.memo.clear()
    value, end = _SCAN(line, 0)
    if line[end:].strip():
        raise ValueError("extra data")
    return value


def dumps(value, ref=None):
    return line_of(encode(value, ref))


class Malformed(ValueError):
    """A description that is not one."""


def _as_int(data):
    if type(data) is int:
        return data
    if type(data) is list and len(data) == 2 and data[0] == "i" and type(data[1]) is str:
        try:
            return int(data[1], 16)
        except ValueError:
            raise Malformed("a bad integer") from None
    raise Malformed("not an integer")


def _as_float(data):
    if type(data) is float or type(data) is int:
        return float(data)
    if type(data) is list and len(data) == 2 and data[0] == "f" and \
            data[1] in ("inf", "-inf", "nan"):
        return float(data[1])
    raise Malformed("not a float")


_NAMEDTUPLES = {}


def _namedtuple(name, fields):
    key = (name, tuple(fields))
    if key not in _NAMEDTUPLES:
        if len(_NAMEDTUPLES) > 256 or len(fields) > 256:
            raise Malformed("too many named tuples")
        try:
            _NAMEDTUPLES[key] = collections.namedtuple(name, fields)
        except (TypeError, ValueError) as e:
            raise Malformed(f"a bad named tuple ({e})") from None
    return _NAMEDTUPLES[key]


def decode(data, ref=None):
    """The value ``data`` describes, built from trusted types only; ``ref(id, kind, name)``
    -> what a reference stands for. Raises :class:`Malformed` (or ``RecursionError``)."""
    def dec(d):
        return decode(d, ref)

    t = type(data)
    if data is None or t is bool or t is str or t is int or t is float:
        return data
    if t is not list or not data or type(data[0]) is not str:
        raise Malformed("not a value")
    tag, rest = data[0], data[1:]
    try:
        if tag in _SEQUENCES:
            return _SEQUENCES[tag](map(dec, rest))
        if tag in ("D", "Counter", "OD", "I"):
            if len(rest) % 2:
                raise Malformed("an odd mapping")
            pairs = [(dec(rest[i]), dec(rest[i + 1])) for i in range(0, len(rest), 2)]
            if tag == "I":
                return dict(pairs).items()
            if tag == "Counter":
                return collections.Counter(dict(pairs))
            return (dict if tag == "D" else collections.OrderedDict)(pairs)
        if tag == "dd":
            if not rest or len(rest) % 2 != 1 or (rest[0] is not None and
                                                   rest[0] not in _FACTORIES):
                raise Malformed("a bad defaultdict")
            pairs = [(dec(rest[i]), dec(rest[i + 1])) for i in range(1, len(rest), 2)]
            return collections.defaultdict(_FACTORIES.get(rest[0]), pairs)
        if tag == "dq":
            if not rest or (rest[0] is not None and type(rest[0]) is not int):
                raise Malformed("a bad deque")
            return collections.deque(map(dec, rest[1:]), rest[0])
        if tag == "K":
            return dict.fromkeys(map(dec, rest)).keys()
        if tag == "V":
            return dict(enumerate(map(dec, rest))).values()
        if tag == "i":
            return _as_int(data)
        if tag == "f":
            return _as_float(data)
        if tag == "c" and len(rest) == 2:
            return complex(_as_float(rest[0]), _as_float(rest[1]))
        if tag in ("b", "B") and len(rest) == 1 and type(rest[0]) is str:
            raw = _module("base64").b64decode(rest[0].encode("ascii"), validate=True)
            return raw if tag == "b" else bytearray(raw)
        if tag == "dec" and len(rest) == 1 and type(rest[0]) is str and len(rest[0]) < 10_000:
            return _module("decimal").Decimal(rest[0])
        if tag == "fr" and len(rest) == 2:
            return _module("fractions").Fraction(_as_int(rest[0]), _as_int(rest[1]))
        if tag == "range" and len(rest) == 3:
            return range(*map(_as_int, rest))
        if tag == "N" and len(rest) >= 2 and type(rest[0]) is str and type(rest[1]) is list \
                and all(type(f) is str for f in rest[1]):
            return _namedtuple(rest[0], rest[1])(*map(dec, rest[2:]))
        if tag == "builtin" and len(rest) == 1 and rest[0] in BUILTINS:
            return getattr(builtins, rest[0])
        if tag == "R" and ref is not None and len(rest) == 3 and type(rest[0]) is int:
            return ref(rest[0], rest[1], rest[2])
    except (TypeError, ValueError, ArithmeticError) as e:  # Decimal's InvalidOperation too
        if isinstance(e, Malformed):
            raise
        raise Malformed(f"a bad {tag} ({type(e).__name__})") from None
    raise Malformed(f"an unknown description {tag[:20]!r}")
