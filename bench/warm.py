"""Warm sandboxes: a ``swe`` job's INIT cold (the handler's own INIT: the repository's files
and its ``.git``, the sandbox started, the setup run) against warm (a sandbox the warm pool
built ahead for the same instance, taken and adopted by the job), for the sample SWE
repository (examples/swe) and a real SWE-bench instance (examples/swe-bench, its
environment built once beforehand, as on a node that ran it before).

    .venv/bin/python bench/warm.py [--jobs 20] [--record]

Both in the same run, on bubblewrap sandboxes as the pools use, through the code the INIT
pool runs (``SweHandler.init``; ``WarmPool.take``); per instance, ``--jobs`` INITs each
way, p50 and p95. The warm pool builds its sandboxes before the timed INITs (a READY stage
ahead of the queue); what a build costs is the cold INIT's.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, private_redis, report  # noqa: E402
from prorl_farm.config import load_settings  # noqa: E402
from prorl_farm.context import JobContext  # noqa: E402
from prorl_farm.handlers.registry import HandlerRegistry  # noqa: E402
from prorl_farm.jobs.store import JobStore  # noqa: E402
from prorl_farm.sandbox.manager import SandboxManager  # noqa: E402
from prorl_farm.worker.warm import WarmPool, init_key  # noqa: E402

DATA = ROOT / "examples" / "swe-bench"


def sample_instance(dest: Path) -> dict:
    spec = importlib.util.spec_from_file_location("swe_build", ROOT / "examples/swe/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(dest)[0]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(handler, pool: WarmPool, manager, settings, instance: dict, jobs: int) -> dict:
    def ctx(job_id: str) -> JobContext:
        return JobContext(job_id=job_id, batch_id="bench", stage="init", token="t",
                          node=settings.node, instance=instance, sampling={},
                          deadline_monotonic=time.monotonic() + 3600, sandboxes=manager,
                          settings=settings)

    handler.init(ctx("warm-up"))  # the environment built, the repository cached
    manager.stop_for_job("warm-up")
    cold = []
    for i in range(jobs):
        t0 = time.perf_counter()
        handler.init(ctx(f"cold-{i}"))
        cold.append(time.perf_counter() - t0)
        manager.stop_for_job(f"cold-{i}")
    key = init_key("default", "swe", instance)
    for _ in range(jobs):  # the READY stage, ahead of the jobs (not timed)
        pool._launch(key, "swe", instance)
    t_end = time.monotonic() + 600
    while pool.r.llen(f"prorl:warm:{settings.node}:ready:{key}") < jobs:
        assert time.monotonic() < t_end, "warm builds did not finish"
        time.sleep(0.05)
    warm = []
    for i in range(jobs):
        c = ctx(f"job-{i}")
        t0 = time.perf_counter()
        state = pool.take("swe", c)
        warm.append(time.perf_counter() - t0)
        assert state and state["sandbox"]["meta"]["job_id"] == f"job-{i}", state
        manager.stop_for_job(f"job-{i}")
    return {"cold": cold, "warm": warm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prs-warm-", dir="/var/tmp"))
    os.chmod(work, 0o755)
    sample = sample_instance(work / "repos")
    real = json.loads((DATA / "instances.jsonl").read_text().splitlines()[0])
    results = {}
    with private_redis() as url:
        env = {"PRORL_REDIS_URL": url, "PRORL_NODE": "bench",
               "PRORL_SANDBOX_MOUNT_ROOTS": f"{work / 'repos'},{DATA / 'repos'}",
               "PRORL_SWE_ENV_DIR": str(ROOT / ".prorl" / "swe-envs"),
               "PRORL_WARM_POOL": str(args.jobs), "PRORL_WARM_TTL_S": "3600",
               "PRORL_WARM_BUILDERS": "2"}
        settings = load_settings(env)
        r = redis.Redis.from_url(url, decode_responses=True)
        store = JobStore(r, settings)
        registry = HandlerRegistry(settings.handlers)
        handler = registry.get("swe")
        manager = SandboxManager(r, settings.node, "bwrap", root=f"/tmp/prs-wbench-{os.getpid()}",
                                 mount_roots=settings.sandbox_mount_roots,
                                 trusted_roots=(settings.swe_env_dir,))
        pool = WarmPool(store, settings, registry, manager)
        try:
            for name, raw in (("sample SWE repository (examples/swe)", sample),
                              (f"SWE-bench {real['instance_id']}", real)):
                instance = handler.validate_instance(raw)
                results[name] = measure(handler, pool, manager, settings, instance, args.jobs)
                print(name, {k: round(statistics.median(v) * 1000, 1)
                             for k, v in results[name].items()}, file=sys.stderr, flush=True)
        finally:
            pool.close()
            for box in manager.records():
                manager.stop(box)
            shutil.rmtree(work, ignore_errors=True)
    lines = [f"### warm sandboxes — {time.strftime('%Y-%m-%d')} — {machine()}", "",
             f"A `swe` job's INIT, {args.jobs} each way per instance, bubblewrap sandboxes: "
             "cold (the handler's INIT: files, `.git`, sandbox, `git reset`; the environment "
             "built beforehand) against warm (a sandbox the warm pool built ahead for the "
             "instance, taken and adopted by the job).", "",
             "| instance | cold p50 ms | cold p95 ms | warm p50 ms | warm p95 ms | "
             "cold / warm (p50) |", "|---|---|---|---|---|---|"]
    for name, res in results.items():
        c50, c95 = pct(res["cold"], 0.5) * 1000, pct(res["cold"], 0.95) * 1000
        w50, w95 = pct(res["warm"], 0.5) * 1000, pct(res["warm"], 0.95) * 1000
        lines.append(f"| {name} | {c50:.1f} | {c95:.1f} | {w50:.2f} | {w95:.2f} | "
                     f"{c50 / w50:.0f}x |")
    report(lines + [""], args.record)


if __name__ == "__main__":
    main()
