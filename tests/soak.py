"""The tests that break only under load, run again and again beside a CPU hog: `make soak`.

A test that passes alone and fails on a loaded machine is a bug (a wait for time where a
wait for a condition belongs, a race): this finds it before CI does. Each round runs the
selection (the fault, liveness, leave, Slurm, compose and sandbox tests by default) in one pytest
process while ``--hog`` busy processes take every core, then the tally: each test's
passes and failures over the rounds, the first line of each failure, the time per round.

    tests/soak.py [--runs N] [--hog K] [--record PATH] [-- PYTEST_ARGS...]

Exit status 0 only if every test passed in every round. ``--record`` appends the figures
(date, machine, rounds, hog, per test) to a Markdown file (docs/testing.md keeps them).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".prorl" / "soak"
# What `make soak` runs by default: the tests of recovery (kill -9 of pools, of Redis and
# of a Sentinel service's primary, the watchdog), of liveness and leaving (SIGTERM with
# re-queue, dead nodes' queues), of the Slurm deployment and of the compose deployment, and
# the sandboxes' (caps, isolation, nothing left behind).
DEFAULT = ["tests/test_faults.py", "tests/test_failover.py", "tests/test_liveness.py",
           "tests/test_slurm.py", "tests/test_compose.py", "tests/test_fair.py",
           "tests/test_sandbox.py"]


def _hog(stop) -> None:
    """A busy loop (a core's worth of CPU) until ``stop`` is set."""
    os.nice(0)
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def _cases(path: Path) -> list[tuple[str, str]]:
    """(test, '' if it passed else the first line of its failure) of a JUnit XML file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if case.find("skipped") is not None:
            continue
        why = "" if bad is None else ((bad.get("message") or "failed").splitlines() or
                                      ["failed"])[0][:200]
        out.append((name, why))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=int(os.environ.get("SOAK_RUNS", 5)))
    p.add_argument("--hog", type=int, default=os.cpu_count() or 2,
                   help="busy processes beside the tests (default: one per core)")
    p.add_argument("--record", default="", help="append the figures to this Markdown file")
    p.add_argument("pytest_args", nargs="*")
    args = p.parse_args(argv)
    selection = args.pytest_args or DEFAULT
    RESULTS.mkdir(parents=True, exist_ok=True)
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_hog, args=(stop,), daemon=True)
            for _ in range(args.hog)]
    for h in hogs:
        h.start()
    tally: dict[str, list[str]] = defaultdict(list)
    times = []
    try:
        for i in range(args.runs):
            xml = RESULTS / f"round-{i}.xml"
            print(f"\n=== soak round {i + 1}/{args.runs} beside {args.hog} CPU hog(s)",
                  flush=True)
            t = time.monotonic()
            subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                            f"--junitxml={xml}", *selection], cwd=ROOT,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
            times.append(time.monotonic() - t)
            for name, why in _cases(xml) if xml.exists() else [("(no report)", "crashed")]:
                tally[name].append(why)
    finally:
        stop.set()
        for h in hogs:
            h.join(5)
            if h.is_alive():
                h.kill()
    failures = {n: [w for w in whys if w] for n, whys in tally.items()}
    failures = {n: w for n, w in failures.items() if w}
    print(f"\n=== soak: {len(tally)} tests x {args.runs} rounds beside {args.hog} CPU "
          f"hog(s); rounds took {', '.join(f'{t / 60:.1f}' for t in times)} min")
    for name, whys in sorted(failures.items()):
        print(f"FAILED {len(whys)}/{len(tally[name])}  {name}\n    {whys[0]}")
    print(f"{sum(len(w) for w in failures.values())} failure(s) in "
          f"{sum(len(w) for w in tally.values())} test runs")
    if args.record:
        _record(Path(args.record), args, tally, failures, times)
    return 1 if failures or not tally else 0


def _record(path: Path, args, tally, failures, times) -> None:
    lines = [f"\n### Soak, {datetime.date.today().isoformat()} ({platform.node()}, "
             f"{os.cpu_count()} cores; {args.runs} rounds beside {args.hog} CPU hogs)\n",
             f"{len(tally)} tests, {sum(len(w) for w in tally.values())} runs, "
             f"**{sum(len(w) for w in failures.values())} failures**; a round took "
             f"{min(times) / 60:.1f}-{max(times) / 60:.1f} min.\n"]
    for name, whys in sorted(failures.items()):
        lines.append(f"- {name}: {len(whys)}/{len(tally[name])} failed: {whys[0]}")
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
