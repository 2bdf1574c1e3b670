"""Tool-server benchmark: bash round trips through the sandbox's Unix socket against the
usual alternatives, IPython, sandbox start/stop, memory per idle sandbox.

  python bench/tools.py [--n 300] [--record] [--docker-image IMAGE]

With ``--docker-image`` (an engine reached through DOCKER_HOST; ``deploy/base-image.sh``
makes an image with no registry), docker sandboxes too: their memory counts the host's
share of each (the ``docker run`` client and the engine's shim), not only what runs inside.

Baselines measured in the same run: a bare in-process ptyprocess shell (the floor: same
bash, no socket, no sandbox), a tmux session driven by send-keys and capture-pane polled
every 10 ms (the common approach), and a fresh ``bash -c`` per command.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from common import machine, pct, private_redis, report  # noqa: E402

from prorl_farm.sandbox.abstract import SandboxSpec, processes_of  # noqa: E402
from prorl_farm.sandbox.connection import ToolConnection  # noqa: E402
from prorl_farm.sandbox.manager import SandboxManager  # noqa: E402
from prorl_farm.toolserver.bash import BashSession  # noqa: E402


def timed(fn, n: int, warmup: int = 10) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - t0))
    return out


def interleaved(fns: dict, n: int, rounds: int = 10) -> dict[str, list[float]]:
    """Round trips of each method, measured in turns (``rounds`` slices of ``n``), so
    that drift in the machine's speed falls on every method alike."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            out[k] += timed(fn, max(1, n // rounds), warmup=3)
    return out


def bench_bash_c(n: int) -> list[float]:
    return timed(lambda: subprocess.run(["bash", "-c", "echo hi"], capture_output=True), n)


def bench_tmux(n: int, poll_s: float = 0.01) -> list[float] | None:
    if not shutil.which("tmux"):
        return None
    name = f"prorl-bench-{os.getpid()}"
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "200", "-y", "50",
                    "bash --norc --noprofile"], check=True)
    counter = [0]

    def once() -> None:
        counter[0] += 1
        marker = f"__DONE_{counter[0]}__"
        subprocess.run(["tmux", "send-keys", "-t", name, f"echo hi; echo {marker}", "Enter"],
                       check=True)
        while True:
            time.sleep(poll_s)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", name],
                                    capture_output=True, text=True).stdout
            if f"\n{marker}" in screen:
                subprocess.run(["tmux", "clear-history", "-t", name])
                subprocess.run(["tmux", "send-keys", "-t", name, "clear", "Enter"])
                return

    try:
        return timed(once, n, warmup=3)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name])


def pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def host_side(sb) -> list[int]:
    """A sandbox's processes outside it: for docker, its client and the engine's shim for
    its container (found by the container's id on the shim's command line)."""
    if sb.runtime != "docker":
        return []
    import psutil

    cid = subprocess.run(["docker", "inspect", "-f", "{{.Id}}", f"prorl-{sb.id}"],
                         capture_output=True, text=True).stdout.strip()
    shims = [p.pid for p in psutil.process_iter(["name", "cmdline"])
             if cid and (p.info["name"] or "").startswith("containerd-shim")
             and cid in " ".join(p.info["cmdline"] or [])]
    return [sb.pid, *shims]


def idle_mib(manager: SandboxManager, k: int) -> float:
    """Memory (PSS) per idle sandbox with ``k`` of them up: pages shared between sandboxes
    (the interpreter's, the client binary's) count once, as on a busy node."""
    sandboxes = [manager.start(SandboxSpec()) for _ in range(k)]
    try:
        time.sleep(0.5)
        pids = {pid for sb in sandboxes for pid in (*processes_of(sb.id), *host_side(sb))}
        return pss_kib(sorted(pids)) / 1024 / k
    finally:
        for sb in sandboxes:
            manager.stop(sb)


def bench_runtime(r, runtime: str, n: int, starts: int, bash_with: dict,
                  image: str = "", idle: int = 8) -> dict:
    """Start/stop times, IPython, idle memory; bash round trips interleaved with those of
    ``bash_with`` (label -> callable), which the result holds under ``with``."""
    manager = SandboxManager(r, f"bench-{runtime}", runtime,
                             root=f"/tmp/prorl-bench-{os.getpid()}", image=image)
    start_ms, stop_ms = [], []
    for _ in range(starts):
        t0 = time.perf_counter()
        sb = manager.start(SandboxSpec())
        start_ms.append(1000 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        manager.stop(sb)
        stop_ms.append(1000 * (time.perf_counter() - t0))
    one = idle_mib(manager, 1)
    many = idle_mib(manager, idle)
    sb = manager.start(SandboxSpec())
    client = ToolConnection(sb.socket)
    try:
        bash = interleaved({**bash_with, "sandbox": lambda: client.bash("echo hi")}, n)
        client.ipython("1+1")  # start the kernel
        ipy = timed(lambda: client.ipython("1+1"), max(20, n // 5), warmup=3)
    finally:
        client.close()
        manager.stop(sb)
        shutil.rmtree(manager.root, ignore_errors=True)
    return {"bash": bash.pop("sandbox"), "with": bash, "ipython": ipy, "start": start_ms,
            "stop": stop_ms, "idle_mib": one, "idle_mib_many": many}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--tmux-n", type=int, default=50)
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--idle", type=int, default=8,
                    help="sandboxes up at once for the memory per sandbox")
    ap.add_argument("--docker-image", default="",
                    help="also docker sandboxes in this image (the engine: DOCKER_HOST)")
    args = ap.parse_args()

    with private_redis() as url, tempfile.TemporaryDirectory() as d:
        r = redis.Redis.from_url(url, decode_responses=True)
        shell = BashSession(d)  # the floor, measured in turns with each sandbox's socket
        shell.start()
        try:
            wanted = ["local"] + (["bwrap"] if shutil.which("bwrap") else []) + (
                ["docker"] if args.docker_image else [])
            runtimes = {rt: bench_runtime(r, rt, args.n, args.starts,
                                          {"floor": lambda: shell.run("echo hi")},
                                          args.docker_image if rt == "docker" else "",
                                          args.idle)
                        for rt in wanted}
        finally:
            shell.close()
        bash_c = bench_bash_c(args.n)
        tmux = bench_tmux(args.tmux_n)

    floor = [x for res in runtimes.values() for x in res["with"]["floor"]]
    f50 = pct(floor, 50)
    rows = [("in-process ptyprocess shell (floor)", floor)]
    rows += [(f"tool server over its socket, {rt} sandbox", res["bash"])
             for rt, res in runtimes.items()]
    rows += [("fresh `bash -c` per command", bash_c)]
    if tmux:
        rows.append(("tmux send-keys + capture-pane, polled every 10 ms", tmux))
    lines = [f"### tools — {datetime.date.today().isoformat()} — {machine()}", "",
             "`echo hi` round trip:", "",
             "| method | p50 (ms) | p99 (ms) | p50 / floor |", "|---|---|---|---|"]
    for label, xs in rows:
        lines.append(f"| {label} | {pct(xs, 50):.3f} | {pct(xs, 99):.3f} | "
                     f"{pct(xs, 50) / f50:.2f} |")
    best = min(pct(res["bash"], 50) for res in runtimes.values())
    worst = max(pct(res["bash"], 50) for res in runtimes.values())
    lines += [""]
    if tmux:
        lines.append(f"Tool server vs tmux polling: **{pct(tmux, 50) / worst:.0f}x** faster "
                     f"(p50); vs `bash -c`: **{pct(bash_c, 50) / worst:.1f}x**; "
                     f"socket + sandbox cost over the floor: {worst / f50:.2f}x "
                     f"(best {best / f50:.2f}x; each measured in turns with the floor).")
    base = runtimes.get("bwrap") or runtimes["local"]
    base_name = "bwrap" if "bwrap" in runtimes else "local"
    lines += ["", f"| runtime | start p50 (ms) | stop p50 (ms) | start+stop / {base_name} | "
              f"IPython `1+1` p50 (ms) | PSS of one idle sandbox (MiB) | "
              f"PSS per sandbox, {args.idle} idle (MiB) |",
              "|---|---|---|---|---|---|---|"]
    cycle = statistics.median(base["start"]) + statistics.median(base["stop"])
    for rt, res in runtimes.items():
        mine = statistics.median(res["start"]) + statistics.median(res["stop"])
        lines.append(f"| {rt} | {statistics.median(res['start']):.0f} | "
                     f"{statistics.median(res['stop']):.0f} | {mine / cycle:.2f} | "
                     f"{pct(res['ipython'], 50):.2f} | {res['idle_mib']:.1f} | "
                     f"{res['idle_mib_many']:.1f} |")
    if "docker" in runtimes:
        lines += ["", "docker's memory counts its `docker run` client and the engine's shim "
                  "(the host's share of each sandbox), not the engine itself."]
    lines.append("")
    report(lines, args.record)


if __name__ == "__main__":
    main()
