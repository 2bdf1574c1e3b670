"""The suite as `make test` and `make check` run it, with its time as a visible number.

Phases: ruff; the tests that can run side by side, on ``--workers`` pytest-xdist workers
(``--dist loadgroup``: the tests that share one real part, vLLM or the Docker engine, run
on one worker, which starts it once); then the tests marked ``serial`` (they need the
machine alone), on their own. At the end: the 15 slowest tests, the time of each phase
(installs included when ``--installs-since`` says when they began: `make test`), and each
failed test with its reason::

    tests/suite.py [--check] [--workers N] [--installs-since EPOCH] [-- PYTEST_ARGS...]

``--check`` is the inner loop (`make check`): ruff and the tests not marked ``slow`` (no
real engine, Docker, Slurm or GRPO run). The exit status is that of the first phase that
failed; a later phase still runs, so one run reports every failure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / ".prorl" / "test-results"
LINTED = ["prorl_farm", "api", "workers", "tests", "bench", "examples"]
NO_TESTS = 5  # pytest's exit status when a selection holds no test
# Side by side, more workers than cores: an OpenMP thread (torch's in the tests' own models
# and trainers) spins for a core another worker is using while it waits for its peers. One
# thread each halves the CPU of a torch-heavy module under load (tests/test_tokens.py, beside
# a hog on every core: 50 s to 26 s of CPU). Unless the caller sets them.
SIDE_BY_SIDE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="ruff and the fast tests only")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--installs-since", type=float, default=None,
                   help="when the installs began (seconds since the epoch)")
    p.add_argument("pytest_args", nargs="*")
    args = p.parse_args(argv)
    phases: list[tuple[str, float, int]] = []
    if args.installs_since is not None:
        phases.append(("installs", time.time() - args.installs_since, 0))
    RESULTS.mkdir(parents=True, exist_ok=True)
    for old in [*RESULTS.glob("*.xml"), *RESULTS.glob("timeline-*.txt"),
                *RESULTS.glob("cpu-*.txt")]:
        old.unlink()

    phases.append(_timed("ruff", [sys.executable, "-m", "ruff", "check", *LINTED]))
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    fast = ["-m", "not slow and not serial"] if args.check else ["-m", "not serial"]
    workers = ["-n", str(args.workers), "--dist", "loadgroup"] if args.workers > 1 else []
    phases.append(_timed("tests, side by side", [
        *base, *workers, *fast, f"--junitxml={RESULTS / 'parallel.xml'}", *args.pytest_args],
        SIDE_BY_SIDE_ENV if args.workers > 1 else {}))
    if not args.check:
        phases.append(_timed("tests, alone (serial)", [
            *base, "-m", "serial", f"--junitxml={RESULTS / 'serial.xml'}",
            *args.pytest_args]))
    _report(phases)
    failed = [rc for _, _, rc in phases if rc not in (0, NO_TESTS)]
    return failed[0] if failed else 0


def _timed(name: str, argv: list[str], env: dict | None = None) -> tuple[str, float, int]:
    print(f"\n=== {name}: {' '.join(argv[2:])}", flush=True)
    t = time.monotonic()
    env = {**{k: v for k, v in (env or {}).items() if k not in os.environ}, **os.environ}
    rc = subprocess.run(argv, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}).returncode
    return name, time.monotonic() - t, rc


def slowest(paths, n: int = 15) -> list[tuple[float, str]]:
    """The ``n`` slowest tests of these JUnit XML files (setup, call and teardown)."""
    times = []
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            times.append((float(case.get("time") or 0), name))
    return sorted(times, reverse=True)[:n]


def hungriest(paths, n: int = 15) -> tuple[list[tuple[float, str]], float]:
    """The ``n`` tests that took the most CPU time (with the servers and subprocesses they
    started; conftest.py measures it where the kernel accounts it), and the sum of all."""
    times = []
    for path in paths:
        for line in path.read_text().splitlines():
            seconds, name = line.split(" ", 1)
            times.append((float(seconds), name))
    return sorted(times, reverse=True)[:n], sum(s for s, _ in times)


def failures(paths, width: int = 2000) -> list[str]:
    """Each failed or erroring test of these JUnit XML files with why: its message and the
    last lines of its report (the ``E`` lines and where), cut to ``width`` characters, so that
    the end of a long run's output says what failed even where its middle is cut."""
    out = []
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            for bad in (*case.iter("failure"), *case.iter("error")):
                name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                lines = (bad.text or "").rstrip().splitlines()
                why = [line for line in lines if line.startswith("E ")][:12] or lines[-12:]
                where = [line for line in lines[-3:] if ".py:" in line]
                text = "\n".join([f"{bad.tag}: {name}", *why, *where])
                out.append(text if len(text) <= width else text[:width] + " [...]")
    return out


def _report(phases: list[tuple[str, float, int]]) -> None:
    print("\n=== the 15 slowest tests (seconds, setup and teardown included)")
    for seconds, name in slowest(sorted(RESULTS.glob("*.xml"))):
        print(f"{seconds:8.1f}  {name}")
    top, total = hungriest(sorted(RESULTS.glob("cpu-*.txt")))
    if top:
        print(f"\n=== the 15 tests that took the most CPU (seconds; {total / 60:.1f} min for "
              "all tests, their containers' not counted)")
        for seconds, name in top:
            print(f"{seconds:8.1f}  {name}")
    print("\n=== time per phase")
    for name, seconds, rc in phases:
        status = "" if rc in (0, NO_TESTS) else f"  (exit status {rc})"
        print(f"{seconds / 60:6.1f} min  {name}{status}")
    print(f"{sum(s for _, s, _ in phases) / 60:6.1f} min  in all", flush=True)
    bad = failures(sorted(RESULTS.glob("*.xml")))
    if bad:
        print(f"\n=== {len(bad)} failed, and why (their whole reports are above)")
        print("\n\n".join(bad), flush=True)


if __name__ == "__main__":
    sys.exit(main())
