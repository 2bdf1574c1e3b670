"""Print the project's import graph, its cycles and any import the layering forbids:
``python -m prorl_farm.dev.imports``.

Reads the source with ``ast`` (nothing is imported), counts every import, at module level
or inside a function, of one project module by another, and reports the strongly connected
components of more than one module (import cycles) and every import that breaks a rule of
LAYERS (docs/architecture.md explains them). Exit status 1 if there is either.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGES = ("prorl_farm", "api", "workers")
# What may import what: a module under a prefix on the left imports project modules only
# under the prefixes on the right (or its own). The most specific prefix applies.
_BASE = ("prorl_farm.errors", "prorl_farm.keys", "prorl_farm.states", "prorl_farm.counters")
LAYERS: dict[str, tuple[str, ...]] = {
    # The library never imports the app (api) or the pools' task modules (workers).
    "prorl_farm": ("prorl_farm",),
    # The foundations import nothing of the farm but each other.
    "prorl_farm.errors": (), "prorl_farm.keys": (), "prorl_farm.states": (),
    "prorl_farm.counters": (), "prorl_farm.columns": (), "prorl_farm.retry": (),
    "prorl_farm.config": ("prorl_farm.errors", "prorl_farm.access", "prorl_farm.tenants",
                          "prorl_farm.redisconn"),
    "prorl_farm.redisconn": ("prorl_farm.errors",),
    "prorl_farm.access": ("prorl_farm.errors",),
    "prorl_farm.tenants": ("prorl_farm.errors", "prorl_farm.keys"),
    "prorl_farm.lua": (*_BASE, "prorl_farm.metrics"),
    "prorl_farm.metrics": (*_BASE, "prorl_farm.config", "prorl_farm.fair_view"),
    "prorl_farm.fair_view": _BASE,
    # What runs inside a sandbox: only the wire contract and the exceptions.
    "prorl_farm.toolserver": ("prorl_farm.errors",),
    # The trainer's SDK: HTTP only, no Redis, Celery or farm internals.
    "prorl_farm.trainer": ("prorl_farm.config", "prorl_farm.errors", "prorl_farm.columns",
                           "prorl_farm.retry"),
    # The host side of sandboxes speaks to the tool server through its protocol only.
    "prorl_farm.sandbox": ("prorl_farm.context", "prorl_farm.lua",
                           "prorl_farm.toolserver.protocol", *_BASE),
    "api": ("api", "prorl_farm"),
    "workers": ("workers", "prorl_farm.worker"),
}


def _rule(module: str) -> tuple[str, tuple[str, ...]] | None:
    best = None
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best)):
            best = prefix
    return (best, LAYERS[best]) if best else None


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import LAYERS forbids, as "importer -> imported (rule)"."""
    out = []
    for module, deps in sorted(graph.items()):
        rule = _rule(module)
        if rule is None:
            continue
        prefix, allowed = rule
        for dep in sorted(deps):
            # The bare package (prorl_farm/__init__.py) holds nothing but its path.
            if dep == "prorl_farm" and prefix.startswith("prorl_farm"):
                continue
            if not _under(dep, prefix) and not any(_under(dep, a) for a in allowed):
                out.append(f"{module} -> {dep} (a {prefix} module imports only "
                           f"{', '.join(allowed) or 'nothing of the farm'})")
    return out


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The project module an imported name lives in (``a.b.c`` -> ``a.b`` if c is a name)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path) -> dict[str, set[str]]:
    files = {p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    modules = {_module_name(root, p) for p in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in files:
        me = _module_name(root, path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for t in targets:
                dep = _resolve(t, modules)
                # A package's __init__ importing its own submodules is not a dependency edge
                # worth reporting as a cycle through the package.
                if dep and dep != me and not (path.name == "__init__.py"
                                              and dep.startswith(me + ".")):
                    graph[me].add(dep)
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between subpackages (``prorl_farm.jobs``, ``api``, ...)."""

    def pkg(m: str) -> str:
        return ".".join(m.split(".")[:2]) if m.startswith("prorl_farm.") else m.split(".")[0]

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(pkg(m), set()).update(pkg(d) for d in deps if pkg(d) != pkg(m))
    for deps in list(out.values()):
        for d in deps:
            out.setdefault(d, set())
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    p.add_argument("--edges", action="store_true", help="also print every edge")
    args = p.parse_args(argv)
    graph = import_graph(Path(args.root))
    if args.edges:
        for m in sorted(graph):
            for d in sorted(graph[m]):
                print(f"{m} -> {d}")
    found = cycles(graph)
    packages = cycles(package_graph(graph))
    broken = violations(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, "
          f"{len(found)} module cycles, {len(packages)} package cycles, "
          f"{len(broken)} layering violations")
    for line in broken:
        print("layering: " + line)
    for comp in found:
        print("module cycle: " + " <-> ".join(comp))
    for comp in packages:
        print("package cycle: " + " <-> ".join(comp))
    return 1 if found or packages or broken else 0


if __name__ == "__main__":
    sys.exit(main())
