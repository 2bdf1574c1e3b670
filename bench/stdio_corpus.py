"""A stdin/stdout corpus graded by the farm: the accepted solutions of a public
competitive-programming dataset (APPS, TACO or CodeContests rows, as their files ship them)
through EVAL's ``code`` grading, each beside a bare run of the same program on the same
tests (``python3 -I solution.py``, its output compared by the same checker).

  python bench/stdio_corpus.py --rows FILE [--problems 200] [--solutions 1]
                               [--checker tokens] [--workers 2] [--record]

FILE: JSON lines, a JSON list, or Parquet (pyarrow) of rows in one of these shapes:

- APPS / TACO: ``question``, ``solutions`` (a JSON list of Python programs, as a string),
  ``input_output`` (a JSON string: ``inputs``, ``outputs``; rows with ``fn_name`` are
  call-style and left out), ``problem_id`` or ``id``;
- CodeContests: ``name``, ``public_tests``/``private_tests``/``generated_tests``
  (``{"input": [...], "output": [...]}``), ``solutions`` (``{"language": [...],
  "solution": [...]}``; language 3 is Python 3).

Every accepted solution graded should earn 1.0; a miss is listed with the farm's reason and
the bare run's verdict (a solution its own tests fail when run bare is the dataset's, not
the grader's). The machine needs bubblewrap (EVAL's jail).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import redis
from common import machine, private_redis, report  # noqa: E402

from prorl_farm.config import load_settings  # noqa: E402
from prorl_farm.context import JobContext  # noqa: E402
from prorl_farm.handlers.code import CodeInstance, grade_program, tests_spec  # noqa: E402
from prorl_farm.sandbox.manager import SandboxManager  # noqa: E402
from prorl_farm.sandbox.warm_graders import close_graders  # noqa: E402

PYTHON3 = 3  # CodeContests' language code for Python 3
MAX_TESTS = 50  # per problem, as many of the row's tests as this


def read_rows(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _text(value) -> str:
    return "\n".join(value) + "\n" if isinstance(value, list) else str(value)


def problem(row: dict) -> dict | None:
    """(id, tests, solutions) of a stdio row with Python solutions; None otherwise."""
    if "input_output" in row:  # APPS, TACO
        try:
            io = json.loads(row["input_output"]) if isinstance(row["input_output"], str) \
                else row["input_output"]
            solutions = json.loads(row["solutions"]) if isinstance(row["solutions"], str) \
                else row["solutions"]
        except (TypeError, ValueError):
            return None
        if not io or io.get("fn_name") or not io.get("inputs"):
            return None
        tests = [{"input": _text(i), "output": _text(o)}
                 for i, o in zip(io["inputs"], io["outputs"])]
        ident = row.get("problem_id", row.get("id"))
    elif "solutions" in row and isinstance(row["solutions"], dict):  # CodeContests
        tests = []
        for part in ("public_tests", "private_tests", "generated_tests"):
            got = row.get(part) or {}
            tests += [{"input": i, "output": o}
                      for i, o in zip(got.get("input", []), got.get("output", []))]
        solutions = [s for lang, s in zip(row["solutions"].get("language", []),
                                          row["solutions"].get("solution", []))
                     if lang == PYTHON3]
        ident = row.get("name")
    else:
        return None
    if not tests or not solutions:
        return None
    return {"id": ident, "tests": tests[:MAX_TESTS], "solutions": solutions}


def _checker():
    """The harness's own ``matches`` (the checkers' rules), as it ships."""
    from prorl_farm.graders import source

    harness: dict = {"__name__": "harness"}
    exec(compile(source("code_harness.py"), "code_harness.py", "exec"), harness)
    return harness["matches"]


def bare(program: str, tests: list[dict], checker: dict, time_s: float,
         matches) -> tuple[bool, str]:
    """The program run bare on each test, its output judged by the same checker."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "solution.py"), "w", encoding="utf-8") as f:
            f.write(program)
        for n, test in enumerate(tests):
            try:
                out = subprocess.run([sys.executable, "-I", "solution.py"], cwd=d,
                                     input=test["input"].encode(), capture_output=True,
                                     timeout=10 * time_s)
            except subprocess.TimeoutExpired:
                return False, f"test {n}: timeout"
            if out.returncode != 0:
                return False, f"test {n}: exit status {out.returncode}"
            if not matches(out.stdout.decode(errors="replace"), test["output"], checker):
                return False, f"test {n}: wrong output"
    return True, "ok"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", required=True)
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--solutions", type=int, default=1, help="accepted solutions per problem")
    ap.add_argument("--checker", default="tokens", choices=("tokens", "exact", "floats"))
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    if not shutil.which("bwrap"):
        sys.exit("needs bubblewrap")
    problems = [p for p in map(problem, read_rows(args.rows)) if p][:args.problems]
    cases = [(p, s) for p in problems for s in p["solutions"][:args.solutions]]
    checker = {"kind": args.checker, "tolerance": 1e-6}
    matches = _checker()
    t0 = time.monotonic()
    with private_redis() as url:
        r = redis.Redis.from_url(url, decode_responses=True)
        manager = SandboxManager(r, "bench", "bwrap", root=f"/tmp/prs-stdio-{os.getpid()}")
        settings = load_settings({"PRORL_REDIS_URL": url})

        def one(case):
            prob, program = case
            inst = CodeInstance().load({"statement": "s", "tests": prob["tests"],
                                        "checker": args.checker,
                                        "time_limit_s": args.time_limit,
                                        "canonical_solution": program})
            assert tests_spec(inst)["checker"]["kind"] == args.checker
            ctx = JobContext(job_id=f"s{prob['id']}", batch_id="b", stage="eval", token="t",
                             node="bench", instance=inst, sampling={}, sandboxes=manager,
                             settings=settings)
            verdict = grade_program(ctx, program, inst)
            whys = sorted({t["why"] for t in verdict["tests"] if not t["ok"]})
            own = bare(program, prob["tests"], checker, args.time_limit, matches)
            return {"id": prob["id"], "farm": verdict["reward"] == 1.0,
                    "why": "; ".join(whys)[:160], "own": own[0], "own_why": own[1]}

        try:
            with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
                results = list(pool.map(one, cases))
        finally:
            close_graders()
            shutil.rmtree(manager.root, ignore_errors=True)
    passed = sum(x["farm"] for x in results)
    lines = [f"### stdio corpus — {datetime.date.today()} — {machine()}", "",
             f"`bench/stdio_corpus.py --rows {os.path.basename(args.rows)}`: {len(problems)} "
             f"problems, {len(results)} accepted solutions graded by EVAL's `code` grading "
             f"(checker `{args.checker}`, {time.monotonic() - t0:.0f} s): **{passed} earn 1.0 "
             f"({100 * passed / max(1, len(results)):.1f}%)**; run bare on the same tests, "
             f"{sum(x['own'] for x in results)} pass.", ""]
    for x in results:
        if not x["farm"]:
            lines.append(f"- {x['id']}: farm `{x['why']}`; bare "
                         f"{'pass' if x['own'] else 'fail'} (`{x['own_why']}`)")
    report(lines, args.record)


if __name__ == "__main__":
    main()
