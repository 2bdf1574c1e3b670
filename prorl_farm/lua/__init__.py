"""Every Lua script the farm runs in Redis: one ``.lua`` file each in this folder, shared
functions in ``lib/``.

A script's header states its contract::

    -- name: what it does (more comment lines may follow).
    -- uses: lib, lib          (the lib/*.lua it needs, in any order)
    -- KEYS: name, name        (or "(none)")
    -- ARGV: name, name, rest... (a last name ending in "..." takes a list, flattened)
    -- returns: what it replies

Callers name every KEYS and ARGV entry by keyword (``lua("claim", job=..., stage=...)``),
checked against the header at each call; ``tests/test_lua.py`` checks every call site in
the code the same way, and that each body reads no ARGV or KEYS entry its header lacks.

Key names and the tables a script shares with Python are generated from the Python
definitions when a script is loaded, never copied: ``K`` (every key, :mod:`prorl_farm.keys`),
``TERMINAL`` (the terminal job states), ``CLAIM_FIELDS`` and ``ATTEMPT_FIELDS`` (job hash
fields, :mod:`prorl_farm.states`), ``BACKEND_FIELDS`` (what a pin returns of a backend,
:mod:`prorl_farm.keys`), ``BUCKETS`` (histogram bounds, :mod:`prorl_farm.metrics`) and
``HISTORY_STEP_S`` / ``HISTORY_TTL_S`` (the dashboard's history, :mod:`prorl_farm.metrics`).

Keys: the farm targets one Redis, not a Cluster (docs/architecture.md says why). Job
scripts derive the keys of a job's batch and queue from the job's own hash, so those are
not in ``KEYS``; scripts on keys the caller knows (locks, sandbox slots) take them in
``KEYS``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import redis

HERE = Path(__file__).resolve().parent
LIB = HERE / "lib"


@dataclass(frozen=True)
class Contract:
    """A script's header."""

    name: str
    uses: tuple[str, ...]
    keys: tuple[str, ...]
    argv: tuple[str, ...]
    rest: str  # the last ARGV name that takes a list ('' if none)
    returns: str


def _header(path: Path) -> dict[str, str]:
    """The leading comment block's ``field: value`` entries, continuation lines joined."""
    out: dict[str, str] = {}
    last = ""
    for line in path.read_text().splitlines():
        if not line.startswith("--"):
            break
        text = line[2:].strip()
        m = re.match(r"(uses|KEYS|ARGV|returns):\s*(.*)$", text)
        if m:
            last = m.group(1)
            out[last] = m.group(2)
        elif last and line.startswith("--   "):
            if last in ("KEYS", "ARGV") and not re.match(r"\s*[a-z_]+(, [a-z_]+)*(\.\.\.)?,?$",
                                                          text):
                last = ""  # a description of the names, not more names
                continue
            out[last] += " " + text
        else:
            last = ""
    return out


def _names(value: str) -> tuple[str, ...]:
    value = value.strip()
    if value in ("", "(none)"):
        return ()
    return tuple(n.strip() for n in value.split(",") if n.strip())


@functools.cache
def contract(name: str) -> Contract:
    path = HERE / f"{name}.lua"
    if not path.is_file():
        raise KeyError(f"no Lua script {name!r} in {HERE}")
    head = _header(path)
    for field in ("KEYS", "ARGV", "returns"):
        if field not in head:
            raise ValueError(f"{path.name}: the header has no '{field}:' line")
    argv = _names(head["ARGV"])
    rest = ""
    if argv and argv[-1].endswith("..."):
        rest = argv[-1][:-3]
        argv = argv[:-1] + (rest,)
    return Contract(name, _names(head.get("uses", "")), _names(head["KEYS"]), argv, rest,
                    head["returns"])


def names() -> list[str]:
    """Every script's name."""
    return sorted(p.stem for p in HERE.glob("*.lua"))


def lua_value(v) -> str:
    """A Python value as a Lua literal (str, number, bool, list/tuple, dict of str keys)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "{" + ", ".join(lua_value(x) for x in v) + "}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"[{json.dumps(k)}] = {lua_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no Lua literal for {v!r}")


def tables(code: str | None = None) -> str:
    """The generated tables a script starts with, from their Python definitions: with
    ``code`` (the script's libraries and body), only the keys and tables it names. A script
    builds them at every call, so what it never reads is left out (some microseconds a call
    for ``K`` alone)."""
    from prorl_farm import keys
    from prorl_farm.metrics import BUCKETS_S, HISTORY_STEP_S, HISTORY_TTL_S, SUM_SLOT
    from prorl_farm.states import ATTEMPT_FIELDS, CLAIM_FIELDS, STATE_SLOT, TERMINAL_STATES

    shared = {
        "TERMINAL": {s.value: True for s in sorted(TERMINAL_STATES)},
        "CLAIM_FIELDS": CLAIM_FIELDS,
        "ATTEMPT_FIELDS": ATTEMPT_FIELDS,
        "BACKEND_FIELDS": keys.BACKEND_FIELDS,
        "BUCKETS": BUCKETS_S,
        "SUM_SLOT": SUM_SLOT,
        "STATE_SLOT": STATE_SLOT,
        "HISTORY_STEP_S": HISTORY_STEP_S,
        "HISTORY_TTL_S": HISTORY_TTL_S,
    }
    lines = keys.LUA.splitlines()
    if code is not None:
        used = set(re.findall(r"\bK\.(\w+)", code))
        lines = [lines[0]] + [line for line in lines[1:]
                              if re.match(r"(?:function )?K\.(\w+)", line)[1] in used]
        shared = {k: v for k, v in shared.items() if re.search(rf"\b{k}\b", code)}
    return "\n".join(lines) + "\n" + "".join(f"local {k} = {lua_value(v)}\n"
                                            for k, v in shared.items())


def _libs(uses: tuple[str, ...], seen: list[str]) -> None:
    """``uses`` and what they use, each once, dependencies first."""
    for lib in uses:
        if lib in seen:
            continue
        path = LIB / f"{lib}.lua"
        if not path.is_file():
            raise KeyError(f"no Lua library {lib!r} in {LIB}")
        _libs(_names(_header(path).get("uses", "")), seen)
        seen.append(lib)


_DEFINES = re.compile(r"^local (?:function (\w+)|([\w, ]+?)\s*=)", re.M)
_WORD = re.compile(r"\b[A-Za-z_]\w*\b")


def _needed(libs: list[str], body: str) -> str:
    """Of the libraries' top-level definitions (each from its ``local`` line to the next),
    those the body uses, directly or through another, in their order."""
    chunks: list[tuple[set[str], str]] = []
    for lib in libs:
        text = (LIB / f"{lib}.lua").read_text()
        starts = [m.start() for m in _DEFINES.finditer(text)]
        for a, b in zip(starts, [*starts[1:], len(text)]):
            m = _DEFINES.match(text, a)
            names = {m[1]} if m[1] else {n.strip() for n in m[2].split(",")}
            chunks.append((names, text[a:b]))
    wanted = set(_WORD.findall(body))
    taken = [False] * len(chunks)
    grew = True
    while grew:
        grew = False
        for i, (names, text) in enumerate(chunks):
            if not taken[i] and names & wanted:
                taken[i] = grew = True
                wanted |= set(_WORD.findall(text))
    return "".join(text for (_, text), t in zip(chunks, taken) if t)


@functools.cache
def source(name: str) -> str:
    """The script as Redis runs it: the generated tables, the definitions of its libraries
    it uses, its body. (A script runs all of it at every call: what it never uses is left
    out.)"""
    libs: list[str] = []
    _libs(contract(name).uses, libs)
    body = (HERE / f"{name}.lua").read_text()
    code = _needed(libs, body) + "\n" + body
    return tables(code) + "\n" + code


class Scripts:
    """The farm's scripts on one Redis client: ``lua(name, **keys_and_argv)``."""

    def __init__(self, client: redis.Redis):
        self.client = client
        self._loaded: dict[str, redis.commands.core.Script] = {}

    def __call__(self, name: str, *, client=None, **named):
        c = contract(name)
        wanted = set(c.keys) | set(c.argv)
        if set(named) != wanted:
            missing, extra = sorted(wanted - set(named)), sorted(set(named) - wanted)
            raise TypeError(f"Lua script {name}: missing {missing}, unexpected {extra}")
        args: list = []
        for a in c.argv:
            if a == c.rest:
                args.extend(named[a])
            else:
                args.append(named[a])
        script = self._loaded.get(name)
        if script is None:
            script = self._loaded[name] = self.client.register_script(source(name))
        return script(keys=[named[k] for k in c.keys], args=args, client=client)
