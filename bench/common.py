"""What every benchmark shares: the machine line, percentiles, a private redis-server."""

from __future__ import annotations

import contextlib
import os
import platform
import posixpath
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prorl_farm.supervisor import free_port, wait_for_redis  # noqa: E402


def graders_at(rev: str | None, names: tuple[str, ...]) -> dict[str, str]:
    """Grader scripts as shipped (``source``, includes expanded): ``rev`` None, this
    checkout's; else the files at that git revision (a benchmark's "before")."""
    from prorl_farm.graders import source

    def read(name):
        path = posixpath.normpath(f"prorl_farm/graders/{name}")  # an include of ../x
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    return {n: source(n, read if rev else None) for n in names}


def machine() -> str:
    return (f"{platform.node()}: {platform.system()} {platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


@contextlib.contextmanager
def private_redis(maxclients: int = 10_000):
    """A throw-away redis-server on a free port; yields its URL."""
    with tempfile.TemporaryDirectory() as d:
        port = free_port()
        server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no", "--dir", d,
                                   # as the farm's own Redis servers run (prorl_farm/keys.py)
                                   "--hash-max-listpack-value", "1024",
                                   "--maxclients", str(maxclients)],
                                  stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            wait_for_redis(url)
            yield url
        finally:
            server.terminate()
            server.wait()


def report(lines: list[str], record: bool) -> None:
    """Print the result table; with ``record``, append it to bench/RESULTS.md."""
    print("\n".join(lines))
    if record:
        with open(ROOT / "bench" / "RESULTS.md", "a") as f:
            f.write("\n".join(lines) + "\n")
