"""Real SWE-bench instances (examples/swe-bench): the instance table, and what the farm's
grading and INIT cost against the bare work in the same run.

  python bench/swebench.py [--rounds 3] [--before REV] [--record]

Per instance, in bubblewrap sandboxes like the pools' (the environment bound read-only):

- environment build: cold (a fresh environment directory; the package cache warm, as on a
  node that built any environment before) and cached (the lookup a job does);
- INIT with the environment cached: the repository's files and the base commit's ``.git``,
  the sandbox started, the index made (``git reset``): what the ``swe`` handler's INIT does;
- grading: the farm's harness on the gold patch (jail with the kernel's boundary, audit
  hook, evidence pipe, pytest's report as a second witness, every test of SWE-bench's test
  files), against the floor: SWE-bench's eval steps run bare in the same kind of sandbox
  (apply both patches, ``pytest -rA`` on the same files); and, with ``--before REV``, the
  harness as it was at git revision REV, in turns in the same run;
- the verdicts of the gold patch, the empty patch and a wrong one (half the gold hunks, or
  a comment), and swebench 5.0.2's own verdict on the farm's log of each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
from common import graders_at as shipped_at  # noqa: E402
from common import machine, private_redis, report  # noqa: E402

from prorl_farm.sandbox.abstract import Limits, SandboxSpec  # noqa: E402
from prorl_farm.sandbox.connection import ToolConnection  # noqa: E402
from prorl_farm.sandbox.isolated import tagged_verdict  # noqa: E402
from prorl_farm.sandbox.manager import SandboxManager  # noqa: E402
from prorl_farm.swebench import repos, verdicts  # noqa: E402
from prorl_farm.swebench.envs import EnvBuilder, spec_for  # noqa: E402
from prorl_farm.swebench.instance import (  # noqa: E402
    GRADER_DIR,
    Prepared,
    command_words,
    grading_spec,
    runner_of,
)
from prorl_farm.swebench.tree import (  # noqa: E402
    PROTECTED_NAMES,
    PROTECTED_SUFFIXES,
    SKIP_DIRS,
    builds_native,
    patch_paths,
    trusted_code,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "swe-bench"
sys.path.insert(0, str(ROOT))
from tests.test_swebench import repo_roots, swebench, wrong_patch  # noqa: E402


def run(manager, files, argv, env, stdin=None) -> tuple[float, dict]:
    sb = manager.start(SandboxSpec(workspace_files=files, limits=Limits(processes=256),
                                   ro_paths=env.ro_paths))
    client = ToolConnection(sb.socket)
    try:
        t0 = time.perf_counter()
        out = client.call("exec", argv=argv, timeout_s=900, stdin=stdin, env=env.sandbox_env)
        return time.perf_counter() - t0, out
    finally:
        client.close()
        manager.stop(sb)


def graders_at(rev: str | None) -> dict[str, str]:
    """The harness and runner as shipped (``rev`` None: this checkout's; else that
    revision's)."""
    return shipped_at(rev, ("swe_harness.py", "swe_runner.py"))


def grade(manager, row, prep, patch: str | None, graders: dict | None = None
          ) -> tuple[float, dict]:
    """The farm's harness (``graders``: its sources, default this checkout's) on ``patch``
    (None: the base tree): seconds, verdict."""
    graders = graders or graders_at(None)
    tree = {**prep.base, **prep.overlay}
    test_paths = patch_paths(row["test_patch"])
    spec = grading_spec({**row, "test_timeout_s": 900}, prep,
                        patch_paths(patch or ""), test_paths,
                        {"protected_names": sorted(PROTECTED_NAMES),
                         "protected_suffixes": list(PROTECTED_SUFFIXES),
                         "skip_dirs": list(SKIP_DIRS), "noexec": not builds_native(tree),
                         "trusted": trusted_code(tree)})
    files = {**tree, f"{GRADER_DIR}/spec.json": json.dumps(spec),
             f"{GRADER_DIR}/test.patch": row["test_patch"],
             **{f"{GRADER_DIR}/{n}": text for n, text in graders.items()}}
    if patch:
        files[f"{GRADER_DIR}/model.patch"] = patch
    nonce = secrets.token_hex(8)
    took, out = run(manager, files, [prep.env.python, "-I", f"{GRADER_DIR}/swe_harness.py",
                                     ".", GRADER_DIR], prep.env, nonce + "\n")
    verdict = tagged_verdict(out["stdout"], nonce)
    assert verdict and "outcomes" in verdict, (out["stdout"][-2000:], out["stderr"][-2000:])
    return took, verdict


def bare_command(spec, test_patch: str) -> str:
    """SWE-bench's test command on its test directives, as its eval script runs it: a
    script the command names run by the environment's python (the workspace keeps no file
    modes), from the repository's root with the script's directory first on the path (the
    sandbox's exec sets PYTHONSAFEPATH for graders: unset here, as in SWE-bench's image)."""
    runner = runner_of(spec)
    assigns, program = command_words(spec)
    if program[0].endswith((".py", "bin/test")):
        program = ["python", *program]
    return " ".join(["env", "-u", "PYTHONSAFEPATH", *map(shlex.quote, assigns),
                     *map(shlex.quote, program),
                     *verdicts.test_directives(test_patch, runner)])


def bare(manager, row, prep) -> float:
    files = {**prep.base, **prep.overlay, ".bare/gold.patch": row["patch"],
             ".bare/test.patch": row["test_patch"]}
    command = ("git apply .bare/gold.patch && git apply .bare/test.patch && "
               f"{bare_command(prep.spec, row['test_patch'])} > .bare/log 2>&1; true")
    took, out = run(manager, files, ["bash", "-c", command], prep.env)
    assert out["exit_code"] == 0, out
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", metavar="REV",
                    help="also grade with the harness of this git revision, in turns")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--only", nargs="*", metavar="ID", help="instances whose id has this")
    args = ap.parse_args()
    now, before = graders_at(None), graders_at(args.before) if args.before else None
    rows = [json.loads(line) for line in (DATA / "instances.jsonl").read_text().splitlines()
            if line.strip()]
    work = Path(tempfile.mkdtemp(prefix="prs-swebench-", dir="/var/tmp"))
    os.chmod(work, 0o755)
    builder = EnvBuilder(str(work / "envs"))
    cache = str(work / "repos")
    os.makedirs(cache)
    table, ratios, inits, against = [], [], [], []
    roots = repo_roots()
    if args.only:
        rows = [r for r in rows if any(o in r["instance_id"] for o in args.only)]
    with private_redis() as url:
        r = redis.Redis.from_url(url, decode_responses=True)
        manager = SandboxManager(r, "bench", "bwrap", root=f"/tmp/prs-sbench-{os.getpid()}",
                                 trusted_roots=(str(work),))
        try:
            built = {}
            for row in rows:
                spec = spec_for(row["repo"], row["version"])
                git_dir = repos.find_source(row["repo"], roots, cache)
                setup = row["environment_setup_commit"]
                files = repos.tree(git_dir, setup)
                base = {"base_files": repos.tree(git_dir, row["base_commit"]),
                        "base_commit": repos.full_commit(git_dir, row["base_commit"])}
                t0 = time.perf_counter()
                env = builder.ensure(spec, files, repos.full_commit(git_dir, setup), **base)
                cold = time.perf_counter() - t0
                cold_text = f"{cold:.1f}" + ("" if spec.name not in built else " (packages built)")
                built[spec.name] = cold
                t0 = time.perf_counter()
                env = builder.ensure(spec, files, repos.full_commit(git_dir, setup), **base)
                cached = time.perf_counter() - t0
                prep = Prepared(spec, git_dir, row["base_commit"], env)
                for _ in range(args.rounds):  # INIT with the environment cached
                    t0 = time.perf_counter()
                    again = builder.ensure(spec, repos.tree(git_dir, setup),
                                           repos.full_commit(git_dir, setup), **base)
                    ws = Prepared(spec, git_dir, row["base_commit"],
                                  again).workspace(row["base_commit"])
                    sb = manager.start(SandboxSpec(workspace_files=ws, ro_paths=again.ro_paths,
                                                   env=again.sandbox_env))
                    client = ToolConnection(sb.socket)
                    out = client.call("exec", argv=["git", "reset", "-q"], timeout_s=60,
                                      env={})
                    inits.append((row["instance_id"], time.perf_counter() - t0))
                    assert out["exit_code"] == 0, out
                    client.close()
                    manager.stop(sb)
                farm_s, bare_s, before_s = [], [], []
                for _ in range(args.rounds):  # in turns
                    took, gold = grade(manager, row, prep, row["patch"], now)
                    farm_s.append(took)
                    bare_s.append(bare(manager, row, prep))
                    if before:
                        before_s.append(grade(manager, row, prep, row["patch"], before)[0])
                _, empty = grade(manager, row, prep, None)
                base_file = prep.base[row["patch"].split("diff --git a/", 1)[1].split(" ")[0]]
                _, wrong = grade(manager, row, prep, wrong_patch(row, base_file.decode()))
                decided = {}
                for kind, v in (("gold", gold), ("empty", empty), ("wrong", wrong)):
                    d = verdicts.verdict(v["outcomes"], v.get("exit_code"),
                                        verdicts.test_names(row["FAIL_TO_PASS"]),
                                        verdicts.test_names(row["PASS_TO_PASS"]),
                                        runner_of(spec))
                    theirs = swebench("5.0.2", "report", [{"instance": row, "log":
                                      verdicts.log_text(v.get("output", ""),
                                                       v.get("exit_code"))}])[0]
                    decided[kind] = (d["resolved"], theirs["resolved"])
                ratio = statistics.median(farm_s) / statistics.median(bare_s)
                ratios.append(ratio)
                then = (f" {statistics.median(before_s):.1f} | "
                        f"{statistics.median(farm_s) / statistics.median(before_s):.2f} |"
                        if before else "")
                if before:
                    against.append(statistics.median(farm_s) / statistics.median(before_s))
                table.append(
                    f"| {row['instance_id']} | {env.manifest['python_version']} | "
                    f"{cold_text} / "
                    f"{cached * 1000:.0f} ms | {statistics.median(farm_s):.1f} | "
                    f"{statistics.median(bare_s):.1f} | {ratio:.2f} |{then} "
                    + " | ".join(f"{'resolved' if ours else 'no'}"
                                 f"{' (=)' if ours == theirs else ' (DIFFERS)'}"
                                 for ours, theirs in decided.values()) + " |")
        finally:
            shutil.rmtree(manager.root, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    init_ms = sorted(t * 1000 for _, t in inits)
    lines = [f"### swebench — {datetime.date.today().isoformat()} — {machine()}", "",
             f"{len(rows)} SWE-bench instances (examples/swe-bench), bwrap sandboxes; "
             f"medians of {args.rounds} rounds in turns. Environment: cold build (package "
             "cache warm) / cached lookup. Grading: the farm's harness on the gold patch vs "
             "SWE-bench's eval steps bare (`git apply`, the spec's test command on the test "
             "directives: `pytest -rA`, `tests/runtests.py`, `bin/test`) in the same sandbox. "
             "Verdicts: ours, and (=) where swebench 5.0.2's `get_eval_report` on our log "
             "says the same.", "",
             "| instance | Python | environment cold (s) / cached | farm grading (s) | "
             "bare (s) | farm / bare | " + (f"farm at {args.before} (s) | now / then | "
                                            if before else "") + "gold | empty | wrong |",
             "|---|---|---|---|---|---|" + ("---|---|" if before else "") + "---|---|---|",
             *table, "",
             f"Grading, farm / bare: median **{statistics.median(ratios):.2f}x** (max "
             f"{max(ratios):.2f}x). INIT with the environment cached (files, .git of the "
             f"base commit, sandbox start, `git reset`): p50 **{statistics.median(init_ms):.0f}"
             f" ms**, max {max(init_ms):.0f} ms."
             + (f" Grading, this harness / the harness at {args.before}: median "
                f"**{statistics.median(against):.2f}x** (max {max(against):.2f}x)."
                if before else ""), ""]
    report(lines, args.record)


if __name__ == "__main__":
    main()
