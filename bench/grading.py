"""Grading benchmark: what the graders' isolation costs, against the bare work in the same
run and the same sandbox.

  python bench/grading.py [--tests 20] [--answers 200] [--before REV] [--record]

- ``code``: a stdin/stdout task of N tests graded by the harness (tests on its stdin, the
  program in a jail per test), against the floor: ``python3 -I solution.py`` run N times by
  a plain loop in the same kind of sandbox.
- ``code``, call style: an MBPP-style problem (a function, 3 asserts with literal results)
  graded by the harness, against MBPP's own way (the program and the asserts in one
  ``python3 -I`` process) in the same kind of sandbox; with ``--before REV``, also the
  harness of that revision, in turns.
- ``swe``: the sample repository's named tests under the harness (jailed runner, audit hook,
  integrity checks, evidence pipe), against the floor: ``python3 -m pytest`` on the same
  tests in the same kind of sandbox.
- ``math``: one answer graded by math-verify in a bounded helper process (warm), against
  the floor: math-verify called in the benchmark's own process.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
from common import graders_at, machine, private_redis, report  # noqa: E402

from prorl_farm.graders import answers, source  # noqa: E402
from prorl_farm.sandbox.abstract import Limits, SandboxSpec  # noqa: E402
from prorl_farm.sandbox.connection import ToolConnection  # noqa: E402
from prorl_farm.sandbox.manager import SandboxManager  # noqa: E402
from prorl_farm.swebench.tree import (  # noqa: E402
    _git_tree,
    builds_native,
    patch_paths,
    trusted_code,
)

ROOT = Path(__file__).resolve().parent.parent
DOUBLE = "import sys\nprint(2 * int(sys.stdin.read()))\n"
FLOOR_LOOP = ("import subprocess, sys\nfor i in range(int(sys.argv[1])):\n"
              "    subprocess.run([sys.executable, '-I', 'solution.py'], input=str(i).encode(),"
              " capture_output=True)\n")


def in_sandbox(manager, files, argv, stdin=None, processes=64) -> float:
    """Seconds for one ``exec`` of ``argv`` in a fresh sandbox (start and stop excluded)."""
    sb = manager.start(SandboxSpec(workspace_files=files, limits=Limits(processes=processes)))
    client = ToolConnection(sb.socket)
    try:
        t0 = time.perf_counter()
        out = client.call("exec", argv=argv, timeout_s=600, stdin=stdin, env={})
        elapsed = time.perf_counter() - t0
        assert out["exit_code"] == 0, (out["stdout"][-3000:], out["stderr"][-2000:])
        return elapsed
    finally:
        client.close()
        manager.stop(sb)


def bench_code(manager, n_tests: int, rounds: int) -> dict:
    spec = {"style": "stdio", "nonce": "N", "time_s": 5, "memory_mb": 512,
            "tests": [{"input": str(i), "output": str(2 * i)} for i in range(n_tests)]}
    harness, floor = [], []
    for _ in range(rounds):  # in turns, so both see the same machine
        harness.append(in_sandbox(manager, {"solution.py": DOUBLE, "code_harness.py":
                                            source("code_harness.py")},
                                  ["python3", "-I", "-S", "code_harness.py"], json.dumps(spec)))
        floor.append(in_sandbox(manager, {"solution.py": DOUBLE, "loop.py": FLOOR_LOOP},
                                ["python3", "-I", "loop.py", str(n_tests)]))
    return {"harness": statistics.median(harness) / n_tests * 1000,
            "floor": statistics.median(floor) / n_tests * 1000}


CALL_PROGRAM = "def add(a, b):\n    return a + b\n"
CALL_TESTS = ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(10, 5) == 15"]


def harness_at(rev: str | None) -> str:
    """The code harness as shipped (``rev`` None: this checkout's; else that revision's)."""
    return graders_at(rev, ("code_harness.py",))["code_harness.py"]


def bench_calls(manager, rounds: int, before: str | None) -> dict:
    spec = {"style": "call", "nonce": "N", "time_s": 5, "memory_mb": 512,
            "entry_point": "add", "cases": CALL_TESTS, "setup": "",
            "jail_seen": True}  # as a pool that has graded before sends it
    harnesses = {"now": harness_at(None), **({"before": harness_at(before)} if before else {})}
    own = CALL_PROGRAM + "\n".join(CALL_TESTS) + "\n"
    times = {name: [] for name in [*harnesses, "floor"]}
    for _ in range(rounds):  # in turns, so all see the same machine
        for name, harness in harnesses.items():
            times[name].append(in_sandbox(manager, {"solution.py": CALL_PROGRAM,
                                                    "code_harness.py": harness},
                                          ["python3", "-I", "-S", "code_harness.py"],
                                          json.dumps(spec)))
        times["floor"].append(in_sandbox(manager, {"own.py": own}, ["python3", "-I", "own.py"]))
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def bench_swe(manager, rounds: int) -> dict:
    spec = importlib.util.spec_from_file_location("swe_build", ROOT / "examples/swe/build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    with tempfile.TemporaryDirectory() as d:
        inst = build.build(Path(d))[0]
        base = _git_tree(str(Path(d) / "prorl__calc"), inst["base_commit"])
    tests = inst["FAIL_TO_PASS"] + inst["PASS_TO_PASS"]
    grader = {"grader/spec.json": json.dumps({
                  "tests": tests, "setup": [], "changed": sorted(patch_paths(inst["patch"])),
                  "test_files": sorted(patch_paths(inst["test_patch"])), "timeout_s": 120,
                  "noexec": not builds_native(base), "trusted": trusted_code(base)}),
              "grader/test.patch": inst["test_patch"], "grader/model.patch": inst["patch"],
              "grader/swe_harness.py": source("swe_harness.py"),
              "grader/swe_runner.py": source("swe_runner.py")}
    repo = {f"repo/{p}": data for p, data in base.items()}
    floor_cmd = ("cd repo && git apply ../grader/model.patch && git apply ../grader/test.patch"
                 " && PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider "
                 + " ".join(tests) + " >/dev/null")
    harness, floor = [], []
    for _ in range(rounds):
        harness.append(in_sandbox(manager, {**repo, **grader},
                                  ["python3", "-I", "grader/swe_harness.py"], "N\n", 256))
        floor.append(in_sandbox(manager, {**repo, **grader}, ["bash", "-c", floor_cmd],
                                processes=256))
    return {"harness": statistics.median(harness) * 1000,
            "floor": statistics.median(floor) * 1000}


def bench_math(n: int) -> dict:
    request = {"kind": "math", "text": "so \\boxed{\\frac{1}{2}}", "reference": "0.5",
               "max_chars": 200}
    answers.grade(request)  # a warm helper, as in a running pool
    answers.grade_math(request["text"], request["reference"])
    helper, floor = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        assert answers.grade(request) == (1.0, "correct")
        helper.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert answers.grade_math(request["text"], request["reference"]) == (1.0, "correct")
        floor.append(time.perf_counter() - t0)
    answers.close_helpers()
    return {"harness": statistics.median(helper) * 1000,
            "floor": statistics.median(floor) * 1000}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--answers", type=int, default=200)
    ap.add_argument("--before", metavar="REV", help="also the code harness of this revision")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    if not shutil.which("bwrap"):
        sys.exit("needs bubblewrap")
    with private_redis() as url:
        r = redis.Redis.from_url(url, decode_responses=True)
        manager = SandboxManager(r, "bench", "bwrap", root=f"/tmp/prs-gbench-{os.getpid()}")
        try:
            code = bench_code(manager, args.tests, args.rounds)
            calls = bench_calls(manager, args.rounds, args.before)
            swe = bench_swe(manager, args.rounds)
        finally:
            shutil.rmtree(manager.root, ignore_errors=True)
    math = bench_math(args.answers)
    lines = [f"### grading — {datetime.date.today().isoformat()} — {machine()}", "",
             "What the graders' isolation costs, against the bare work in the same run "
             f"(medians of {args.rounds} rounds in turns; math: {args.answers} answers).", "",
             "| grading | isolated (ms) | floor (ms) | isolated / floor |", "|---|---|---|---|",
             f"| code: per stdin/stdout test ({args.tests} tests; jail per test vs a bare "
             f"`python3 solution.py`) | {code['harness']:.1f} | {code['floor']:.1f} | "
             f"{code['harness'] / code['floor']:.2f} |",
             f"| code, call style: a problem of 3 asserts (one jailed program answering the "
             f"calls vs MBPP's way, one bare process) | {calls['now']:.1f} | "
             f"{calls['floor']:.1f} | {calls['now'] / calls['floor']:.2f} |",
             *([f"| code, call style: the same, the harness at {args.before} | "
                f"{calls['before']:.1f} | {calls['floor']:.1f} | "
                f"{calls['before'] / calls['floor']:.2f} (now / then: "
                f"{calls['now'] / calls['before']:.2f}) |"] if args.before else []),
             f"| swe: the sample's 2 named tests (jailed runner, audit hook, integrity, "
             f"evidence pipe vs bare pytest) | {swe['harness']:.0f} | {swe['floor']:.0f} | "
             f"{swe['harness'] / swe['floor']:.2f} |",
             f"| math: one answer (bounded helper process vs math-verify in-process) | "
             f"{math['harness']:.2f} | {math['floor']:.2f} | "
             f"{math['harness'] / math['floor']:.2f} |", ""]
    report(lines, args.record)


if __name__ == "__main__":
    main()
