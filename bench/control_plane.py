"""The control plane at N nodes, simulated: what one Redis spends on the farm's own traffic as
nodes are added, 2 -> 10 -> 100 -> 1,000 nodes of 64 sandboxes running 60 s jobs.

A node here is the farm's own code with the sandboxes and the model taken out: its INIT,
RUN and EVAL pool processes are three ``Liveness`` objects (worker/liveness.py), each with
its presence connection and its main process's ``Reaper``, ticked as their threads tick
(every heartbeat interval: held jobs' heartbeats, a pool beat and slot registration every
2 s, the reaper's lease and, on the leader, its sweeps; a clock read; the janitor's lock),
on a simulated clock (``time.monotonic`` in those modules) so that 1,000 nodes' seconds can
be driven from one process at whatever pace it manages; Redis's own clock stays real. The
RUN pool of every node holds 64 real jobs (claimed through the real scripts) for the whole
run: their heartbeats are what 64 sandboxes busy with 60 s jobs cost. A dashboard reads the
farm's overview every 2 s.

Two phases per N, the same number of simulated seconds each:
- A, the nodes alone: Redis CPU per simulated second (INFO cpu) and commands;
- B, the same plus a stream of jobs through every step a job makes of Redis: a submission
  (64 jobs each), INIT's pop, claim, sandbox slot and hand-off, RUN's pop, claim and
  hand-off, EVAL's pop, claim, slot release and finish. (B - A) / jobs is a job's own cost;
  each claim's latency is timed.

At the target (N nodes x 64 sandboxes / 60 s = N x 1.07 jobs/s), Redis CPU per second is
A's per second plus the rate times a job's own cost, and the cost per job is that over the
rate.

    .venv/bin/python bench/control_plane.py [--nodes 2,10,100,1000] [--seconds 10]
        [--jobs 2000] [--record]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, pct, private_redis, report  # noqa: E402
from prorl_farm import keys  # noqa: E402
from prorl_farm.celery_app import create_celery_app, queue_for  # noqa: E402
from prorl_farm.config import load_settings  # noqa: E402
from prorl_farm.jobs.messages import StageMessages  # noqa: E402
from prorl_farm.jobs.store import JobStore, connect  # noqa: E402
from prorl_farm.llm.registry import BackendRegistry  # noqa: E402
from prorl_farm.overview import farm_overview  # noqa: E402
from prorl_farm.states import JobState  # noqa: E402
from prorl_farm.worker import liveness as liveness_mod  # noqa: E402
from prorl_farm.worker import reaper as reaper_mod  # noqa: E402
from prorl_farm.worker.kombu import message_args  # noqa: E402
from prorl_farm.worker.liveness import Liveness, present  # noqa: E402
from prorl_farm.worker.reaper import Reaper  # noqa: E402

SANDBOXES = 64  # per node: RUN holds this many jobs
JOB_S = 60.0
SLOTS = {"init": 8, "run": SANDBOXES + 16, "eval": 8}
DASHBOARD_S = 2.0
SUBMIT = 64  # jobs per submission


class SimClock:
    """``time`` as the simulated nodes see it: monotonic() is simulated, the rest real."""

    def __init__(self):
        self.now = time.monotonic()
        self.ns = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time)
                                           if not k.startswith("_")})
        self.ns.monotonic = lambda: self.now

    def install(self) -> None:
        liveness_mod.time = self.ns
        reaper_mod.time = self.ns


class Held:
    """What a Liveness needs of a running stage it heartbeats."""

    def __init__(self):
        self.remaining_s = 1e9
        self.abort_event = threading.Event()

    def abort(self, reason: str) -> None:
        self.abort_event.set()


class Node:
    def __init__(self, i: int, base, store: JobStore, messages: StageMessages):
        self.name = f"n{i}"
        self.settings = dataclasses.replace(base, node=self.name)
        self.pools = {}
        for stage in ("init", "run", "eval"):
            reaper = Reaper(store, self.settings, messages, BackendRegistry(store.r), present)
            lv = Liveness(store, self.settings, stage, reaper=reaper)
            lv.slots = (queue_for(stage, self.name), SLOTS[stage], 0)
            self.pools[stage] = lv

    def tick(self) -> None:
        for lv in self.pools.values():
            lv.tick()

    def close(self) -> None:
        for lv in self.pools.values():
            lv.presence.close()


def redis_cost(r) -> tuple[dict[str, int], float]:
    """Redis's calls so far by command (those inside scripts too; ``<command> usec``: the
    microseconds spent in each), its round trips, and its CPU seconds."""
    stats = r.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    calls.update({k.removeprefix("cmdstat_") + " usec": int(v["usec"])
                  for k, v in stats.items()})
    calls["(round trips)"] = int(r.info("stats")["total_reads_processed"])
    cpu = r.info("cpu")
    return calls, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def script_time(store: JobStore) -> dict[str, float]:
    """Microseconds Redis spent per command or script (by name) since the last slowlog
    reset (the server logs every command: slowlog-log-slower-than 0)."""
    names = {s.sha: name for name, s in store.lua._loaded.items()}
    out: dict[str, float] = {}
    for entry in store.r.slowlog_get(1_000_000):
        cmd = entry["command"]
        cmd = cmd.decode() if isinstance(cmd, bytes) else cmd
        words = cmd.split()
        name = words[0].lower() if words else "?"
        if name == "evalsha" and len(words) > 1:
            name = names.get(words[1], "script " + words[1][:8])
        out[name] = out.get(name, 0.0) + entry["duration"]
    return out


def _command(name: str) -> bool:
    """A command's count (not the round trips, not a time)."""
    return not name.startswith("(") and not name.endswith(" usec")


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in b if b[k] - a.get(k, 0)}


def take_slot(store: JobStore, node: Node, job: str) -> int:
    """A sandbox's slot on the node, as the sandbox manager takes one (from a random
    hint)."""
    slot = store.lua("sandbox_alloc", slots=keys.sandbox_slots(node.name),
                     started=keys.SANDBOXES_STARTED, nodes=keys.SANDBOX_NODES,
                     job=keys.job(job), tenants=keys.sandbox_tenants(node.name),
                     cap=SLOTS["run"], sandbox=f"sb-{job}",
                     hint=random.randrange(SLOTS["run"]), node=node.name)
    assert int(slot) >= 0, "no sandbox slot"
    return int(slot)


def pop(store: JobStore, queue: str) -> tuple[str, str] | None:
    raw = store.r.rpop(queue)
    if raw is None:
        return None
    args = message_args(json.loads(raw))
    return args[0], args[1]


def through_init(store, messages, node: Node, worker: str) -> tuple[str, str]:
    """Pop an INIT message, claim it on ``node``, take a sandbox slot, hand it to RUN."""
    got = pop(store, "init")
    assert got, "no INIT message"
    job, token = got
    init = node.pools["init"]
    ok, _ = store.claim(job, "init", token, worker, init.presence.name)
    assert ok.value == "ok", ok
    take_slot(store, node, job)
    new = store.advance(job, "init", token, "run", queue_for("run", node.name), node.name,
                        "hstate", "{}", messages)
    assert new
    return job, new


def timed_claim(store, lat: list, job, stage, token, worker, holder):
    t0 = time.perf_counter()
    ok, _ = store.claim(job, stage, token, worker, holder)
    lat.append(time.perf_counter() - t0)
    assert ok.value == "ok", ok


def one_job(store, messages, node: Node, lat: list) -> None:
    """A job's every step after its submission (RUN's time itself is not simulated: the
    population's heartbeats stand for it)."""
    t0 = time.perf_counter()
    job, token = pop(store, "init")
    lat.append(time.perf_counter() - t0)
    init = node.pools["init"]
    timed_claim(store, lat, job, "init", token, "w", init.presence.name)
    slot = take_slot(store, node, job)
    token = store.advance(job, "init", token, "run", queue_for("run", node.name), node.name,
                          "hstate", "{}", messages)
    j, token = pop(store, queue_for("run", node.name))
    assert j == job
    timed_claim(store, lat, job, "run", token, "w", node.pools["run"].presence.name)
    token = store.advance(job, "run", token, "eval", queue_for("eval", node.name), node.name,
                          "result", "{}", messages)
    j, token = pop(store, queue_for("eval", node.name))
    assert j == job
    timed_claim(store, lat, job, "eval", token, "w", node.pools["eval"].presence.name)
    store.lua("sandbox_free", slots=keys.sandbox_slots(node.name),
              tenants=keys.sandbox_tenants(node.name), slot=slot, sandbox=f"sb-{job}")
    store.finish(job, JobState.DONE, token=token, fields={"reward": "1.0"})


def run(url: str, n: int, seconds: float, jobs: int, why: bool = False) -> dict:
    base = load_settings({"PRORL_REDIS_URL": url, "PRORL_LOG_LEVEL": "WARNING"})
    store = JobStore(connect(base, 64), base)
    messages = StageMessages(create_celery_app(base))
    clock = SimClock()
    clock.install()
    t0 = time.monotonic()
    nodes = [Node(i, base, store, messages) for i in range(n)]
    for node in nodes:  # every pool's slots registered, presence connected
        node.tick()
    # The population: SANDBOXES jobs held by each node's RUN pool.
    total = n * SANDBOXES
    for start in range(0, total, 2048):
        store.create_jobs(f"pop-{start}", "synthetic", [{}], min(2048, total - start), {},
                          None, messages=messages)

    def populate(node: Node) -> None:
        run_pool = node.pools["run"]
        for _ in range(SANDBOXES):
            job, token = through_init(store, messages, node, "w")
            j, token = pop(store, queue_for("run", node.name))
            ok, _ = store.claim(j, "run", token, "w", run_pool.presence.name)
            assert ok.value == "ok"
            run_pool._running[(j, token)] = Held()

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(populate, nodes))
    setup_s = time.monotonic() - t0
    dash_backends = BackendRegistry(store.r)
    sweeps: list[float] = []
    for rp in (lv.reaper for node in nodes for lv in node.pools.values()):
        inner = rp._sweep  # the leader's sweeps timed

        def timed(inner=inner):
            s = time.perf_counter()
            out = inner()
            sweeps.append(time.perf_counter() - s)
            return out
        rp._sweep = timed

    step = base.heartbeat_interval_s

    def unlogged() -> dict[str, float]:
        """What the log says, and the log off again."""
        out = script_time(store)
        store.r.config_set("slowlog-log-slower-than", 10_000)
        store.r.slowlog_reset()
        return out

    def logged() -> None:
        """Every command logged with its time from now on, to name what the time went to."""
        store.r.config_set("slowlog-log-slower-than", 0)
        store.r.config_set("slowlog-max-len", 1_000_000)
        store.r.slowlog_reset()

    def nodes_alone(seconds: float, log: bool = False) -> dict:
        """``seconds`` simulated of every node's pool processes and the dashboard; ``log``:
        each command's time logged (costs Redis time: a pass of its own)."""
        next_dash = clock.now
        if log:
            logged()
        calls0, cpu0 = redis_cost(store.r)
        w0 = time.monotonic()
        for _ in range(int(round(seconds / step))):
            clock.now += step
            for node in nodes:
                node.tick()
            if clock.now >= next_dash:
                next_dash = clock.now + DASHBOARD_S
                farm_overview(store, dash_backends.list(), base)
        calls1, cpu1 = redis_cost(store.r)
        return {"cpu": cpu1 - cpu0, "calls": _delta(calls0, calls1),
                "wall": time.monotonic() - w0, "scripts": unlogged() if log else {}}

    def jobs_alone(count: int, log: bool = False) -> dict:
        """``count`` jobs through every step, spread over the nodes (the nodes' state all
        there, their ticks not running)."""
        lat: list[float] = []
        if log:
            logged()
        calls0, cpu0 = redis_cost(store.r)
        for k in range(count):
            if k % SUBMIT == 0:
                store.create_jobs(f"flow-{k}", "synthetic", [{}], SUBMIT, {}, None,
                                  messages=messages)
            one_job(store, messages, nodes[k % n], lat)
        calls1, cpu1 = redis_cost(store.r)
        return {"cpu": cpu1 - cpu0, "calls": _delta(calls0, calls1), "lat": lat,
                "scripts": unlogged() if log else {}}

    sweeps.clear()
    a = nodes_alone(seconds)
    a_sweeps = list(sweeps)
    jobs = jobs - jobs % SUBMIT or SUBMIT
    b = jobs_alone(jobs)
    if why:  # a second, logged pass of each: what the time went to
        a["scripts"] = nodes_alone(seconds, log=True)["scripts"]
        b["scripts"] = jobs_alone(jobs, log=True)["scripts"]
    rate = n * SANDBOXES / JOB_S
    per_s_a = a["cpu"] / seconds
    job_cpu = b["cpu"] / jobs
    job_calls = {c: v / jobs for c, v in b["calls"].items()}
    total = per_s_a + rate * job_cpu
    a_calls_s = {c: v / seconds for c, v in a["calls"].items()}
    for node in nodes:
        node.close()
    store.r.close()
    return {
        "nodes": n, "setup_s": setup_s, "rate": rate,
        "a_cpu_ms_s": per_s_a * 1e3, "job_cpu_ms": job_cpu * 1e3, "total_cpu_s_s": total,
        "per_job_ms": total / rate * 1e3, "job_calls": job_calls,
        "job_cmds": sum(v for c, v in job_calls.items() if _command(c)),
        "a_calls_s": a_calls_s,
        "a_cmds_s": sum(v for c, v in a_calls_s.items() if _command(c)),
        "claim_p50_ms": pct(b["lat"], 50) * 1e3, "claim_p99_ms": pct(b["lat"], 99) * 1e3,
        "sweep_p50_ms": pct(a_sweeps, 50) * 1e3 if a_sweeps else 0.0,
        "sweep_max_ms": max(a_sweeps) * 1e3 if a_sweeps else 0.0,
        "pace": seconds / a["wall"], "scripts": a["scripts"],
        "job_scripts": {k: v / jobs for k, v in b["scripts"].items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="2,10,100,1000")
    ap.add_argument("--seconds", type=float, default=10.0, help="simulated, per phase")
    ap.add_argument("--jobs", type=int, default=2000, help="jobs through phase B")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    rows = []
    for n in [int(x) for x in args.nodes.split(",")]:
        with private_redis(maxclients=10_000) as url:
            row = run(url, n, args.seconds, args.jobs, why=True)
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                          for k, v in row.items() if not isinstance(v, dict)}), flush=True)
    lines = [f"### control plane — {date.today()} — {machine()}", "",
             f"Simulated nodes (bench/control_plane.py): each the farm's INIT/RUN/EVAL pool "
             f"processes' liveness threads and reapers, its RUN pool holding {SANDBOXES} "
             f"jobs; jobs of {JOB_S:g} s, so N nodes finish N x {SANDBOXES / JOB_S:.2f} "
             f"jobs/s; a dashboard reading every {DASHBOARD_S:g} s. {args.seconds:g} "
             f"simulated seconds per phase, {args.jobs - args.jobs % SUBMIT or SUBMIT} jobs "
             "through phase B.", "",
             "| nodes | jobs/s at target | nodes alone: Redis CPU ms/s | commands/s | "
             "a job's own: CPU ms | commands | Redis CPU at target (cores) | "
             "CPU ms per job | claim p50 / p99 (ms) | reaper sweep p50 / max (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['nodes']} | {r['rate']:.1f} | {r['a_cpu_ms_s']:.1f} | {r['a_cmds_s']:.0f} "
            f"| {r['job_cpu_ms']:.3f} | {r['job_cmds']:.1f} | {r['total_cpu_s_s']:.3f} | "
            f"{r['per_job_ms']:.3f} | {r['claim_p50_ms']:.2f} / {r['claim_p99_ms']:.2f} | "
            f"{r['sweep_p50_ms']:.1f} / {r['sweep_max_ms']:.1f} |")
    by_n = {r["nodes"]: r for r in rows}
    top, low = by_n[max(by_n)], by_n[10 if 10 in by_n else min(by_n)]
    if top is not low:
        ratio = top["per_job_ms"] / low["per_job_ms"]
        lines += ["", f"Cost per job at {top['nodes']} nodes against {low['nodes']}: "
                  f"**{ratio:.2f}x**. Redis at {top['nodes']} nodes x {SANDBOXES} sandboxes, "
                  f"{JOB_S:g} s jobs: **{top['total_cpu_s_s']:.2f} cores** of this machine."]
        # What the time went to (each command's time as Redis logged it, a pass of its own):
        # per node and second for the nodes alone, per job for a job's own.
        per_node = {k: v / args.seconds / top["nodes"] for k, v in top["scripts"].items()}
        was = {k: v / args.seconds / low["nodes"] for k, v in low["scripts"].items()}
        lines.append(f"Nodes alone at {top['nodes']} nodes, µs of Redis per node and second "
                     f"(at {low['nodes']} nodes): " + ", ".join(
                         f"{k} {v:.0f} ({was.get(k, 0):.0f})" for v, k in sorted(
                             ((v, k) for k, v in per_node.items()), reverse=True)[:6]) + ".")
        lines.append(f"A job's own at {top['nodes']} nodes, µs of Redis per job (at "
                     f"{low['nodes']} nodes): " + ", ".join(
                         f"{k} {v:.0f} ({low['job_scripts'].get(k, 0):.0f})" for v, k in sorted(
                             ((v, k) for k, v in top["job_scripts"].items()), reverse=True)[:6])
                     + ".")
    lines.append("")
    report(lines, args.record)


if __name__ == "__main__":
    main()
