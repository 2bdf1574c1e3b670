"""MBPP as its own harness grades it, and as the farm's ``code`` harness does: every
problem of the full set (974) and of the sanitized one (427), with its reference solution
and with every function body replaced by ``return None``.

  python bench/mbpp.py [--workers 2] [--timing 60] [--record]

MBPP's own harness: the reference, the setup and the asserts executed in one fresh Python
process (``python3 -I -c``), as its evaluation runs them. The farm: EVAL's grading as a pool
runs it (``grade_program``: the ``code`` harness on a warm grader, each program in a fresh
jail) of the instance that ``examples/humaneval/rows.py`` makes of the row. A reference
earns 1.0 in the farm exactly where it passes its own harness; every disagreement is listed
with the reason.

Cost: ``--timing`` problems (every k-th of the full set) graded one at a time, in turns:
MBPP's harness (a process per problem; with the system's ``python3``, which the grading
sandbox runs, and with the farm's own interpreter) against the farm's harness run in its
sandbox, the whole of EVAL's grading in a fresh sandbox (its start and stop as well), and
EVAL's grading on a warm grader (``grade_program`` as a pool runs it,
prorl_farm/sandbox/warm_graders.py). Then the CPU each takes per problem (the machine's busy
time over the same problems graded again one way at a time, from ``/proc/stat``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis
from common import machine, private_redis, report  # noqa: E402

from prorl_farm.config import load_settings  # noqa: E402
from prorl_farm.context import JobContext  # noqa: E402
from prorl_farm.graders import source  # noqa: E402
from prorl_farm.handlers.code import CodeInstance, grade_program, tests_spec  # noqa: E402
from prorl_farm.sandbox.abstract import Limits, SandboxSpec  # noqa: E402
from prorl_farm.sandbox.connection import ToolConnection  # noqa: E402
from prorl_farm.sandbox.manager import SandboxManager  # noqa: E402
from prorl_farm.sandbox.warm_graders import close_graders  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "humaneval"))
from rows import mbpp_row, mbpp_rows  # noqa: E402

BODY = "return None"


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable


def own_harness(row: dict, code: str, python: str = sys.executable) -> tuple[bool, str, float]:
    """MBPP's way: the program, the setup and the asserts in one process."""
    setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
    program = "\n".join([code, setup, *row["test_list"]]) + "\n"
    t0 = time.perf_counter()
    try:
        out = subprocess.run([python, "-I", "-c", program], capture_output=True,
                             text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False, "timeout", time.perf_counter() - t0
    elapsed = time.perf_counter() - t0
    if out.returncode == 0:
        return True, "ok", elapsed
    lines = out.stderr.strip().splitlines()
    return False, (lines[-1] if lines else f"exit {out.returncode}")[:160], elapsed


def farm_harness(manager, row: dict, code: str) -> tuple[bool, str, float, float]:
    """The farm's way: (passed, why, harness seconds, EVAL's seconds with the sandbox)."""
    inst = CodeInstance().load({**mbpp_row(row), "canonical_solution": code})
    # jail_seen: as a pool that has graded before sends it (no probe of the jail)
    spec = {**tests_spec(inst), "nonce": "N", "jail": True, "jail_seen": True}
    t0 = time.perf_counter()
    sb = manager.start(SandboxSpec(workspace_files={"solution.py": code, "code_harness.py":
                                                    source("code_harness.py")},
                                   limits=Limits(processes=64)))
    client = ToolConnection(sb.socket)
    try:
        t1 = time.perf_counter()
        out = client.call("exec", argv=["python3", "-I", "-S", "code_harness.py"],
                          timeout_s=600, stdin=json.dumps(spec), env={})
        harness = time.perf_counter() - t1
    finally:
        client.close()
        manager.stop(sb)
    whole = time.perf_counter() - t0
    try:
        verdict = json.loads(out["stdout"].strip().splitlines()[-1][2:])
    except (IndexError, ValueError):
        return False, f"no verdict: {out['stderr'][-300:]}", harness, whole
    if "error" in verdict:
        return False, f"error: {verdict['error']}", harness, whole
    ok = verdict["passed"] == verdict["total"]
    whys = sorted({r["why"] for r in verdict["results"] if not r["ok"]})
    return ok, "; ".join(whys)[:160] or "ok", harness, whole


def eval_grade(manager, settings, row: dict, code: str) -> tuple[bool, str]:
    """EVAL's grading as a pool runs it (``grade_program``: a warm grader once the jail was
    seen to work)."""
    inst = CodeInstance().load({**mbpp_row(row), "canonical_solution": code})
    ctx = JobContext(job_id=f"m{row['task_id']}", batch_id="b", stage="eval", token="t",
                     node=manager.node, instance=inst, sampling={}, sandboxes=manager,
                     settings=settings)
    verdict = grade_program(ctx, code, inst)
    whys = sorted({t["why"] for t in verdict["tests"] if not t["ok"]})
    return verdict["reward"] == 1.0, "; ".join(whys)[:160] or "ok"


def corpus(manager, settings, rows: list[dict], body: str | None, workers: int) -> list[dict]:
    def one(row):
        code = mbpp_row(row, body)["canonical_solution"]
        own = own_harness(row, code)
        farm = eval_grade(manager, settings, row, code)
        return {"task_id": row["task_id"], "own": own[0], "own_why": own[1],
                "farm": farm[0], "farm_why": farm[1]}

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, rows))


def busy_s() -> float:
    """The machine's busy CPU time so far (every core), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def timing(manager, rows: list[dict], n: int, settings) -> dict:
    picked = rows[::max(1, len(rows) // n)][:n]

    def warm(i: int) -> None:
        assert eval_grade(manager, settings, picked[i], picked[i]["code"])[0]

    warm(0)  # the jail probed once, as a pool's first grading does; warm from then on
    ways = {"own": lambda i: own_harness(picked[i], picked[i]["code"], SYSTEM_PYTHON),
            "own_venv": lambda i: own_harness(picked[i], picked[i]["code"]),
            "harness": None, "whole": None, "warm": warm}
    times = {k: [] for k in ways}
    for i, row in enumerate(picked):  # in turns, one at a time
        for way in ("own", "own_venv", "warm"):
            t0 = time.perf_counter()
            ways[way](i)
            times[way].append(time.perf_counter() - t0)
        _, _, h, w = farm_harness(manager, row, row["code"])
        times["harness"].append(h)
        times["whole"].append(w)
    out = {"n": len(picked), **{k: statistics.median(v) * 1000 for k, v in times.items()}}
    for way in ("own", "warm"):  # CPU: each way over all the problems, alone
        t0 = busy_s()
        for i in range(len(picked)):
            ways[way](i)
        out[f"cpu_{way}"] = (busy_s() - t0) / len(picked) * 1000
    t0 = busy_s()
    for row in picked:
        farm_harness(manager, row, row["code"])
    out["cpu_whole"] = (busy_s() - t0) / len(picked) * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timing", type=int, default=60)
    ap.add_argument("--limit", type=int, default=0, help="the first N problems of each set")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    if not shutil.which("bwrap"):
        sys.exit("needs bubblewrap")
    sets = {"full": mbpp_rows("full"), "sanitized": mbpp_rows("sanitized")}
    if args.limit:
        sets = {k: v[:args.limit] for k, v in sets.items()}
    t = time.monotonic()
    with private_redis() as url:
        r = redis.Redis.from_url(url, decode_responses=True)
        manager = SandboxManager(r, "bench", "bwrap", root=f"/tmp/prs-mbpp-{os.getpid()}")
        try:
            settings = load_settings({"PRORL_REDIS_URL": url})
            cost = timing(manager, sets["full"], args.timing, settings)
            results = {(name, variant): corpus(manager, settings, rows, body, args.workers)
                       for name, rows in sets.items()
                       for variant, body in (("reference", None), ("return None", BODY))}
        finally:
            close_graders()
            shutil.rmtree(manager.root, ignore_errors=True)
    lines = [f"### MBPP — {datetime.date.today().isoformat()} — {machine()}", "",
             f"`bench/mbpp.py`: every problem of MBPP's full (974) and sanitized (427) sets "
             f"as shipped in `examples/mbpp`, graded by MBPP's own harness (the program, the "
             f"setup and the asserts in one process) and by the farm's `code` grading as EVAL "
             f"runs it (the harness on a warm grader, each program in a fresh jail) "
             f"({time.monotonic() - t:.0f} s).", "",
             "| set | programs | n | pass, own harness | pass, farm | disagree |",
             "|---|---|---|---|---|---|"]
    listed = []
    for (name, variant), rows in results.items():
        differ = [x for x in rows if x["own"] != x["farm"]]
        lines.append(f"| {name} | {variant} | {len(rows)} | {sum(x['own'] for x in rows)} | "
                     f"{sum(x['farm'] for x in rows)} | {len(differ)} |")
        listed += [(name, variant, x) for x in differ]
    lines += ["", "Where the references fail under their own harness (the dataset's, so 0 is "
              "right), and every disagreement (none is listed: there is none):", ""]
    header = len(lines)
    for (name, variant), rows in results.items():
        if variant == "reference":
            for x in rows:
                if not x["own"]:
                    lines.append(f"- {name} {x['task_id']}: own harness `{x['own_why']}`; "
                                 f"farm `{x['farm_why']}`")
    for name, variant, x in listed:
        lines.append(f"- **disagree** {name} {variant} {x['task_id']}: own "
                     f"{'pass' if x['own'] else 'fail'} (`{x['own_why']}`), farm "
                     f"{'pass' if x['farm'] else 'fail'} (`{x['farm_why']}`)")
    if len(lines) > header:
        lines[header - 2] = lines[header - 2].replace(" (none is listed: there is none)", "")
    passed_none = [(name, x) for (name, variant), rows in results.items()
                   if variant == "return None" for x in rows if x["farm"]]
    lines += ["", f"`return None` programs that earn 1.0 in the farm: {len(passed_none)}"
              + (" (" + ", ".join(f"{n} {x['task_id']}" for n, x in passed_none) + ")"
                 if passed_none else "") + ".", "",
              f"Cost, {cost['n']} problems of the full set one at a time in turns (medians): "
              f"MBPP's harness {cost['own']:.0f} ms per problem with the system's python3 "
              f"(the grading sandbox's), {cost['own_venv']:.0f} ms with the farm's interpreter; "
              f"EVAL on a warm grader {cost['warm']:.0f} ms "
              f"(**{cost['warm'] / cost['own']:.1f}x** the system python3's, "
              f"{cost['warm'] / cost['own_venv']:.1f}x the farm interpreter's); in a fresh "
              f"sandbox, the harness {cost['harness']:.0f} ms "
              f"({cost['harness'] / cost['own']:.1f}x) and EVAL's whole grading with the "
              f"sandbox's start and stop {cost['whole']:.0f} ms "
              f"({cost['whole'] / cost['own']:.1f}x).", "",
              f"CPU per problem (the machine's busy time, each way alone over the same "
              f"problems): MBPP's harness {cost['cpu_own']:.0f} ms; a warm grader "
              f"{cost['cpu_warm']:.0f} ms ({cost['cpu_warm'] / cost['cpu_own']:.1f}x); a fresh "
              f"sandbox {cost['cpu_whole']:.0f} ms ({cost['cpu_whole'] / cost['cpu_own']:.1f}x).",
              ""]
    report(lines, args.record)


if __name__ == "__main__":
    main()
