"""The Lua scripts' contracts: each header against its body and against every caller."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from prorl_farm import keys, lua
from prorl_farm.metrics import BUCKETS_S
from prorl_farm.states import ATTEMPT_FIELDS, CLAIM_FIELDS, TERMINAL_STATES

ROOT = Path(__file__).resolve().parent.parent
CODE = [p for d in ("prorl_farm", "api", "workers", "bench", "tests")
        for p in (ROOT / d).rglob("*.py")]


def _body(name: str) -> str:
    """The script's code without its comments."""
    text = (lua.HERE / f"{name}.lua").read_text()
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())


def _calls() -> list[tuple[str, int, str, set[str]]]:
    """Every ``<x>.lua("name", ...)`` / ``lua("name", ...)`` call: (file, line, script,
    keyword names)."""
    out = []
    for path in CODE:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            first = node.args[0]
            if called == "lua" and isinstance(first, ast.Constant) and isinstance(first.value,
                                                                                 str):
                out.append((str(path.relative_to(ROOT)), node.lineno, first.value,
                            {k.arg for k in node.keywords if k.arg != "client"}))
    return out


@pytest.mark.parametrize("name", lua.names())
def test_each_header_matches_its_body(name):
    c = lua.contract(name)
    body = _body(name)
    argv = {int(i) for i in re.findall(r"ARGV\[(\d+)\]", body)}
    fixed = len(c.argv) - (1 if c.rest else 0)
    # Every fixed argument is read, and nothing past them but through the rest's loop.
    assert argv == set(range(1, fixed + 1)), (name, sorted(argv), c.argv)
    assert ("#ARGV" in body) == bool(c.rest), name
    assert {int(i) for i in re.findall(r"KEYS\[(\d+)\]", body)} == set(
        range(1, len(c.keys) + 1)), (name, c.keys)
    for lib in c.uses:
        assert (lua.LIB / f"{lib}.lua").is_file(), (name, lib)
    assert c.returns


def test_every_caller_names_the_header_arguments_and_every_script_is_called():
    calls = _calls()
    called = set()
    for where, line, name, kw in calls:
        assert name in lua.names(), f"{where}:{line}: no script {name!r}"
        c = lua.contract(name)
        assert kw == set(c.keys) | set(c.argv), (
            f"{where}:{line}: {name} called with {sorted(kw)}, its header says KEYS "
            f"{c.keys} ARGV {c.argv}")
        called.add(name)
    assert called == set(lua.names()), f"never called: {set(lua.names()) - called}"


def test_a_call_that_disagrees_with_the_header_is_refused_before_redis(r):
    scripts = lua.Scripts(r)
    with pytest.raises(TypeError, match="missing \\['value'\\]"):
        scripts("release_lock", lock="prorl:test:lock")
    with pytest.raises(TypeError, match="unexpected \\['extra'\\]"):
        scripts("release_lock", lock="prorl:test:lock", value="v", extra=1)
    r.set("prorl:test:lock", "v")
    assert scripts("release_lock", lock="prorl:test:lock", value="v") == 1


def test_every_script_loads_and_its_tables_are_the_python_definitions(r):
    for name in lua.names():
        r.script_load(lua.source(name))  # compiles, libraries and tables included
    probe = lua.tables() + """
    local t = {}
    for k in pairs(TERMINAL) do t[#t + 1] = k end
    table.sort(t)
    return cjson.encode({t, CLAIM_FIELDS, ATTEMPT_FIELDS, BACKEND_FIELDS, BUCKETS,
                         K.job('x'), K.ACTIVE})"""
    terminal, claim, attempt, backend, buckets, job, active = json.loads(r.eval(probe, 0))
    assert terminal == sorted(s.value for s in TERMINAL_STATES)
    assert (tuple(claim), tuple(attempt)) == (CLAIM_FIELDS, ATTEMPT_FIELDS)
    assert tuple(backend) == keys.BACKEND_FIELDS
    assert tuple(buckets) == BUCKETS_S
    assert (job, active) == (keys.job("x"), keys.ACTIVE)
