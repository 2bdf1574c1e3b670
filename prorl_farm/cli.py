"""The `prorl-farm` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from prorl_farm.config import STAGES, load_settings, read
from prorl_farm.errors import ConfigError


def _cmd_up(args) -> int:
    from prorl_farm.supervisor import StartupError, Supervisor

    try:
        return Supervisor(load_settings(), dev_model=args.model, auth=args.auth,
                          engine=args.engine, logprobs_mode=args.logprobs_mode).run()
    except StartupError as e:
        print(e, file=sys.stderr)
        return 1


def _cmd_serve_model(args) -> int:
    from prorl_farm.dev.engines import choose, vllm_command

    engine, python, line = choose(args.engine)
    print(line, flush=True)
    if engine == "vllm":
        name = args.name or os.path.basename(os.path.normpath(args.model))
        argv, env = vllm_command(python, args.model, args.host, args.port, name,
                                 dtype=args.dtype, max_model_len=args.max_model_len,
                                 extra=["--logprobs-mode", args.logprobs_mode])
        os.execve(python, argv, env)
    from prorl_farm.dev.devserver import serve

    serve(args.model, args.host, args.port, args.name, max_model_len=args.max_model_len,
          logprobs_mode=args.logprobs_mode)
    return 0


def _cmd_tiny_model(args) -> int:
    from prorl_farm.dev.tiny import build_tiny_model

    print(build_tiny_model(args.out, seed=args.seed, chars=args.chars, small=args.small,
                           tie_embeddings=args.tie_embeddings))
    return 0


def _cmd_worker(args) -> int:
    if args.mount_proc:
        from prorl_farm.sandbox.procfs import (
            ProcMountError,
            exec_without_sys_admin,
            mount_full_proc,
        )

        try:
            mount_full_proc()
        except ProcMountError as e:
            print(e, file=sys.stderr)
            return 2
        exec_without_sys_admin([sys.executable, "-m", "prorl_farm.cli", "worker", args.stage,
                                *args.celery_args])
    from prorl_farm.worker import worker_main

    worker_main(args.stage, args.celery_args)
    return 0


def api_argv(s, host: str | None = None, port: int | None = None) -> list[str]:
    """How the API is served (``prorl-farm api``, and every test and benchmark that runs it
    as deployed): gunicorn's processes, each one event loop that reads requests whole, then
    PRORL_API_THREADS threads that run them (api/server.py: a slow client holds no
    thread)."""
    return [sys.executable, "-m", "gunicorn", "--worker-class", "api.server.Worker",
            "--workers", str(s.api_workers),
            "--bind", f"{host or s.api_host}:{port or s.api_port}",
            # the loop heartbeats every second; long-polls run on the threads, not on it.
            "--timeout", "30", "--graceful-timeout", "5", "--backlog", "4096",
            # (its control socket is one path per user: two farms on a host would share it)
            "--no-control-socket", "api.wsgi:app"]


def _cmd_api(args) -> int:
    s = load_settings()
    if not s.redis_url:
        print("PRORL_REDIS_URL must be set for the API", file=sys.stderr)
        return 2
    from prorl_farm.access import is_loopback
    from prorl_farm.tenants import any_key, parse_tenants

    if not any_key(s.api_token, parse_tenants(s.tenants)) and not is_loopback(s.api_host):
        print(f"the API on {s.api_host} (not loopback) without a key would let anyone read "
              "and run everything: set PRORL_API_TOKEN (or tenants' keys, PRORL_TENANTS), or "
              "bind it to loopback (`prorl-farm up` makes a key up)", file=sys.stderr)
        return 2
    argv = api_argv(s)
    os.execv(sys.executable, argv)
    return 0  # not reached


def _read_key(path: str | None) -> str:
    """The key in ``path`` (a file, so that no command line shows it), or ""."""
    if not path:
        return ""
    with open(path) as f:
        return f.read().strip()


def _cmd_gym(args) -> int:
    """The NeMo Gym agent server (gym/server.py), in the foreground until SIGTERM."""
    import asyncio
    import signal

    from prorl_farm.gym.server import serve
    from prorl_farm.tenants import parse_tenants
    from prorl_farm.worker import logs

    s = load_settings()
    logs.install(s.log_level)
    port = args.port if args.port is not None else s.gym_port
    if not port:
        print("no port: PRORL_GYM_PORT is 0 (give --port)", file=sys.stderr)
        return 2

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        await serve(args.host or s.api_host, port, args.farm or s.url, s.api_token,
                    resources_server=args.resources_server or s.gym_resources_server,
                    grader=args.grader or s.gym_grader, tenants=parse_tenants(s.tenants),
                    own_key=_read_key(args.key_file))

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        pass
    return 0


def _cmd_check_pool(args) -> int:
    """Exit 0 if this node's pool of the stage heartbeats (container and Slurm health
    checks), else 1 with the reason."""
    from prorl_farm.jobs.store import JobStore

    s = load_settings()
    if not s.redis_url:
        print("PRORL_REDIS_URL must be set", file=sys.stderr)
        return 2
    store = JobStore.from_settings(s)
    try:
        age = store.live_pools(s.heartbeat_stale_s).get(f"{args.stage}:{s.node}")
    except Exception as e:
        print(f"redis: {e}", file=sys.stderr)
        return 1
    if age is None:
        print(f"no live {args.stage} pool on node {s.node}", file=sys.stderr)
        return 1
    print(f"{args.stage} pool on {s.node}: heartbeat {age:.1f} s ago")
    return 0


def _read_jsonl(path: str) -> list[dict]:
    """The rows of a ``.jsonl`` file (or a ``.json`` list); a line that is not JSON ends
    the command with its place."""
    from prorl_farm.trainer.swebench import read_json_rows

    try:
        return read_json_rows(path)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _cmd_submit(args) -> int:
    """Submit a dataset, follow the batch to its end, print the summary."""
    import json

    from prorl_farm.trainer import FarmClient
    from prorl_farm.trainer.report import follow

    farm = FarmClient(args.url)
    sampling = json.loads(args.sampling) if args.sampling else {}
    sub = farm.submit(args.handler, _read_jsonl(args.file), n=args.n, sampling=sampling,
                      deadline_s=args.deadline_s)
    print(f"batch {sub['batch_id']}: {len(sub['job_ids'])} jobs", file=sys.stderr)
    print(json.dumps({"batch_id": sub["batch_id"], **follow(farm, sub["batch_id"],
                                                             args.output)}, indent=2))
    return 0


def _cmd_tenants(args) -> int:
    """Each tenant's weight, quotas and usage now, as a table (or JSON)."""
    import json

    from prorl_farm.trainer import FarmClient

    doc = FarmClient(args.url).tenants()
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    cols = ("tenant", "weight", "queued", "in flight", "sandboxes", "done", "failed",
            "store MB", "quotas (queued / in flight / sandboxes / store MB)")
    rows = []
    for t in doc["tenants"]:
        u, q = t["usage"], t["quotas"] or {}
        quota = " / ".join("-" if q.get(k) is None else f"{q[k]:g}"
                           for k in ("max_queued", "max_in_flight", "max_sandboxes",
                                     "max_store_mb"))
        rows.append((t["tenant"], "-" if t["weight"] is None else f"{t['weight']:g}",
                     u["queued"], u["in_flight"], u["sandboxes"], u["done"], u["failed"],
                     f"{u['store_mb']:g}", quota if t["configured"] else "(not configured)"))
    _print_table(cols, rows)
    shares = [(q["queue"], f"{q['shared']} + {q['reserve']}", t["tenant"], t["held"],
               t["waiting"], f"{100 * t['received']:.0f}%", f"{100 * t['due']:.0f}%")
              for q in doc.get("fair_share", []) for t in q["tenants"]]
    if shares:
        print()
        _print_table(("queue", "slots (shared + reserve)", "tenant", "holds", "waiting",
                      "share received", "share due"), shares)
    return 0


def _print_table(cols, rows) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    for row in (cols, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())


def _cmd_watch(args) -> int:
    import json

    from prorl_farm.trainer import FarmClient
    from prorl_farm.trainer.report import follow

    farm = FarmClient(args.url)
    print(json.dumps({"batch_id": args.batch, **follow(farm, args.batch, args.output)},
                     indent=2))
    return 0


def _cmd_export(args) -> int:
    from prorl_farm.trainer import FarmClient

    farm = FarmClient(args.url)
    output = args.output or f"{args.batch}.{args.format}"
    rows = farm.export(args.batch, output, args.format)
    print(f"{rows} trajectories -> {output}", file=sys.stderr)
    return 0


def _validate_line(job: dict) -> tuple[bool, str]:
    """(passes, what one finished reference job says): the reward, SWE's test counts, the
    time its stages took."""
    timings = job.get("timings") or {}
    took = " ".join(f"{stage} {t['active_s']:.1f}s" for stage, t in timings.items()
                    if isinstance(t, dict) and t.get("active_s") is not None)
    if job["state"] != "done":
        failure = job["failure"] or {}
        return False, (f"{job['state']}: {failure.get('kind')}: "
                       f"{failure.get('message', '')[:300]}  ({took})")
    detail = (job.get("result") or {}).get("eval") or {}
    counts = " ".join(f"{short} {len(r['success'])}/{len(r['success']) + len(r['failure'])}"
                      for short, r in (("F2P", (detail.get("report") or {}).get("FAIL_TO_PASS")),
                                       ("P2P", (detail.get("report") or {}).get("PASS_TO_PASS")))
                      if r is not None)
    if job["reward"] == 1.0:
        return True, " ".join(filter(None, ["reward 1.0", counts, f"({took})"]))
    tests = detail.get("tests")
    if isinstance(tests, dict) and all(isinstance(v, dict) for v in tests.values()):
        tests = {k: [t for t, o in v.items() if o not in ("PASSED", "XFAIL", "passed")][:5]
                 for k, v in tests.items()}  # SWE: the tests that did not pass
    why = detail.get("invalid") or detail.get("verdict") or tests or detail
    return False, " ".join(filter(None, [f"reference earns {job['reward']}", counts]))\
        + f": {str(why)[:300]} ({took})"


def _cmd_validate(args) -> int:
    """Grade every instance's own reference through a running farm (the job path training
    uses), one line per instance as it finishes; list those that fail."""
    import time

    from prorl_farm.trainer import FarmClient

    farm = FarmClient(args.url)
    rows = _read_jsonl(args.file)
    started = time.monotonic()
    sub = farm.submit(args.handler, rows, mode="reference", deadline_s=args.deadline_s)
    by_id = {j: i for i, j in enumerate(sub["job_ids"])}
    bad = []
    done = 0
    for job in farm.iter_results(sub["batch_id"], timeout_s=args.deadline_s + 60):
        done += 1
        index = by_id[job["id"]]
        name = rows[index].get("instance_id") or rows[index].get("task_id") or ""
        ok, line = _validate_line(job)
        print(f"[{done}/{len(rows)} {time.monotonic() - started:6.1f}s] {args.file}:"
              f"{index + 1} {name}: {'ok' if ok else 'FAILS'}: {line}", file=sys.stderr,
              flush=True)
        if not ok:
            bad.append((index + 1, line))
    for line, why in sorted(bad):
        print(f"{args.file}:{line}: {why}")
    passing = len(rows) - len(bad)
    print(f"{passing} of {len(rows)} references pass ({100 * passing / max(1, len(rows)):.0f}%)"
          f" in {time.monotonic() - started:.1f}s")
    return 1 if bad else 0


def _cmd_swebench(args) -> int:
    """``swebench grade``: a predictions file graded through a running farm, reported as
    swebench reports it; ``swebench lock``: locks for a user's own instances."""
    import json

    from prorl_farm.trainer import swebench as grading

    try:
        dataset = grading.read_json_rows(args.dataset if args.action == "grade"
                                         else args.file)
        if args.action == "lock":
            from prorl_farm.swebench.locking import lock_rows

            written = lock_rows(dataset, args.out, args.roots.split(",") if args.roots
                                else read("sandbox_mount_roots").split(","),
                                pythons=read("swe_pythons"), force=args.force)
            for path in written:
                print(path)
            return 0
        predictions = grading.read_predictions(args.file)
    except (OSError, ValueError) as e:
        print(f"prorl-farm: {e}", file=sys.stderr)
        return 2
    from prorl_farm.trainer import FarmClient

    out = FarmClient(args.url).grade_swebench(predictions, dataset, args.run_id,
                                              args.report_dir, args.deadline_s)
    report = out["report"]
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("_ids")
                      and k != "failure_reasons"}, indent=2))
    print(f"report: {out['path']}", file=sys.stderr)
    return 0


def _cmd_settings(args) -> int:
    from prorl_farm import config

    if args.deploy:
        for name, doc in config.DEPLOY_ENV.items():
            print(f"{name}\t{doc}")
    else:
        sys.stdout.write(config.table())
    return 0


def _cmd_harness(args) -> int:
    from prorl_farm.config import load_settings
    from prorl_farm.harness import PRESETS, install

    if args.action == "list":
        for name, preset in PRESETS.items():
            print(f"{name}\t{preset.about}")
        return 0
    settings = load_settings()
    into = args.dir or settings.harness_path
    for name in args.names or list(PRESETS):
        if name not in PRESETS:
            raise ConfigError(f"no harness preset {name!r}; presets: {', '.join(PRESETS)}")
        print(f"{name}: {install(name, into, cache=settings.npm_cache)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prorl-farm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    _process_commands(sub)
    _server_commands(sub)
    _batch_commands(sub, read("url"))
    _tool_commands(sub)
    return p


def _process_commands(sub) -> None:
    """The farm's processes: up, a pool, its health check, the API."""
    up = sub.add_parser("up", help="run the whole farm on this machine (private Redis unless "
                        "PRORL_REDIS_URL is set)")
    up.add_argument("--model", "--dev-model", metavar="DIR", dest="model",
                    help="also serve this local Hugging Face model on the CPU (serve-model) and "
                    "register it as a backend")
    up.add_argument("--engine", choices=["dev", "vllm"], default="dev",
                    help="what serves --model: the farm's dev server, or vLLM's CPU build "
                    "where it is installed (make vllm; the dev server otherwise, said so)")
    up.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"],
                    default="raw_logprobs", help="what --model's logprobs are (and the backend "
                    "is registered with): processed for VeRL's actor (docs/trainers.md)")
    up.add_argument("--auth", action="store_true",
                    help="require an API token for every call but the probes: PRORL_API_TOKEN, "
                    "or one made up and printed (always so when PRORL_API_HOST is not "
                    "loopback)")
    up.set_defaults(func=_cmd_up)
    w = sub.add_parser("worker", help="run one stage's worker pool in the foreground")
    w.add_argument("stage", choices=STAGES)
    w.add_argument("--mount-proc", action="store_true",
                   help="in a container that masks parts of /proc (Docker's default) and "
                   "gives CAP_SYS_ADMIN: mount a full proc for bubblewrap, then drop that "
                   "capability and run the pool (docker-compose.yml)")
    w.add_argument("celery_args", nargs=argparse.REMAINDER,
                   help="extra arguments passed to `celery worker`")
    w.set_defaults(func=_cmd_worker)
    cp = sub.add_parser("check-pool", help="exit 0 if this node's (PRORL_NODE) pool of "
                        "STAGE heartbeats; for health checks")
    cp.add_argument("stage", choices=STAGES)
    cp.set_defaults(func=_cmd_check_pool)
    a = sub.add_parser("api", help="serve the HTTP API with gunicorn")
    a.set_defaults(func=_cmd_api)


def _server_commands(sub) -> None:
    """Servers beside the farm: the Gym agent server, a model server."""
    g = sub.add_parser("gym", help="serve the farm as a NeMo Gym agent server (/run, "
                       "/aggregate_metrics, /v1/responses, sessions): each row a farm job, "
                       "through the farm's API (docs/trainers.md)")
    g.add_argument("--host", help="listen address (default: PRORL_API_HOST)")
    g.add_argument("--port", type=int, help="port (default: PRORL_GYM_PORT)")
    g.add_argument("--farm", help="the farm's API (default: PRORL_URL); each caller's own "
                   "key is sent, never the server's")
    g.add_argument("--key-file", metavar="FILE",
                   help="a tenant's own server, for collectors that send no key: rows that "
                   "come without one run with the tenant key in FILE (loopback only; a "
                   "caller that sends a key must send that one)")
    g.add_argument("--resources-server", metavar="[NAME=]URL[,...]",
                   help="Gym resources servers: rows naming no farm task run on them as "
                   "`gym` jobs, on NAME's when the row's agent_ref.name is NAME, else on the "
                   "one without a name (default: PRORL_GYM_RESOURCES_SERVER)")
    g.add_argument("--grader", choices=("math", "contains"),
                   help="the farm grader of rows graded by expected_answer that name none "
                   "and have no resources server (default: PRORL_GYM_GRADER; none: such "
                   "rows are refused)")
    g.set_defaults(func=_cmd_gym)
    sm = sub.add_parser("serve-model", help="serve a local causal LM on the CPU: the farm's "
                        "dev server (vLLM and SGLang routes) or vLLM's CPU build")
    sm.add_argument("--model", required=True, metavar="DIR")
    sm.add_argument("--host", default="127.0.0.1")
    sm.add_argument("--port", type=int, default=8100)
    sm.add_argument("--name", help="model name to report (default: the directory name)")
    sm.add_argument("--engine", choices=["dev", "vllm"], default="dev",
                    help="vllm: vLLM's CPU build where installed (make vllm), with the weight "
                    "sync routes on; the dev server otherwise, said so")
    sm.add_argument("--max-model-len", type=int, default=None,
                    help="context length served (default: the model's)")
    sm.add_argument("--dtype", default="float32", help="vLLM's --dtype (default float32)")
    sm.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"],
                    default="raw_logprobs", help="what the logprobs are (vLLM's flag): before "
                    "temperature and truncation, or of the distribution sampled from (what "
                    "VeRL's actor computes); register the backend with the same")
    sm.set_defaults(func=_cmd_serve_model)


def _batch_commands(sub, url: str) -> None:
    """What a user does with a running farm's batches: submit, watch, export, validate,
    grade SWE-bench predictions; the tenants' usage."""
    s = sub.add_parser("submit", help="submit a JSONL dataset, show progress until the batch "
                       "ends, then a summary (mean reward, pass@k, failures, end reasons)")
    s.add_argument("file", metavar="FILE.jsonl")
    s.add_argument("--handler", required=True)
    s.add_argument("-n", type=int, default=1, help="samples per instance")
    s.add_argument("--sampling", metavar="JSON", help='e.g. \'{"temperature": 1.0}\'')
    s.add_argument("--deadline-s", type=float, default=None)
    s.add_argument("--output", metavar="OUT.jsonl", help="write every finished job here")
    s.add_argument("--url", default=url)
    s.set_defaults(func=_cmd_submit)
    tn = sub.add_parser("tenants", help="each tenant's weight, quotas and usage now (jobs "
                        "queued and in flight, trajectory store MB)")
    tn.add_argument("--json", action="store_true")
    tn.add_argument("--url", default=url)
    tn.set_defaults(func=_cmd_tenants)
    w2 = sub.add_parser("watch", help="follow a batch submitted elsewhere, then summarise it")
    w2.add_argument("batch")
    w2.add_argument("--output", metavar="OUT.jsonl")
    w2.add_argument("--url", default=url)
    w2.set_defaults(func=_cmd_watch)
    e = sub.add_parser("export", help="write a batch's finished trajectories, one row each "
                       "(every field of docs/trajectory.md)")
    e.add_argument("batch")
    e.add_argument("--format", choices=["jsonl", "parquet", "arrow"], default="jsonl")
    e.add_argument("--output", metavar="PATH", help="default: BATCH.FORMAT")
    e.add_argument("--url", default=url)
    e.set_defaults(func=_cmd_export)
    v = sub.add_parser("validate", help="grade each instance's own reference (answer, "
                       "canonical solution) through a running farm; list those that fail")
    v.add_argument("file", metavar="FILE.jsonl")
    v.add_argument("--handler", required=True)
    v.add_argument("--url", default=url)
    v.add_argument("--deadline-s", type=float, default=600.0)
    v.set_defaults(func=_cmd_validate)
    sw = sub.add_parser("swebench", help="SWE-bench as its harness runs it: grade a "
                        "predictions file through a running farm, or lock environments")
    swa = sw.add_subparsers(dest="action", required=True)
    sg = swa.add_parser("grade", help="grade PREDICTIONS (instance_id, model_name_or_path, "
                        "model_patch; .jsonl or .json) on the --dataset rows; write swebench's "
                        "run report (MODEL.RUN_ID.json) and logs/run_evaluation/...")
    sg.add_argument("file", metavar="PREDICTIONS")
    sg.add_argument("--dataset", required=True, metavar="ROWS.jsonl",
                    help="the SWE-bench rows the predictions are for (.jsonl or .json)")
    sg.add_argument("--run-id", default=None, help="default: prorl-DATE-TIME-PID")
    sg.add_argument("--report-dir", default=".")
    sg.add_argument("--deadline-s", type=float, default=3600.0)
    sg.add_argument("--url", default=url)
    sl = swa.add_parser("lock", help="resolve the environment of each (repository, version) "
                        "of ROWS from the package registry once, and write its lock to --out "
                        "(PRORL_SWE_LOCKS then pins it)")
    sl.add_argument("file", metavar="ROWS.jsonl")
    sl.add_argument("--out", required=True, metavar="DIR")
    sl.add_argument("--roots", default="", help="where the repositories are (default: "
                    "PRORL_SANDBOX_MOUNT_ROOTS), comma-separated")
    sl.add_argument("--force", action="store_true", help="make locks that exist again")
    sw.set_defaults(func=_cmd_swebench)


def _tool_commands(sub) -> None:
    """Tools beside the farm: the settings table, harness presets, a tiny model."""
    st = sub.add_parser("settings", help="every PRORL_* setting: default, range, meaning (a "
                        "Markdown table)")
    st.add_argument("--deploy", action="store_true",
                    help="the variables of the compose and Slurm scripts instead")
    st.set_defaults(func=_cmd_settings)
    h = sub.add_parser("harness", help="agent harness presets: list them, or install their "
                       "environments (read-only in sandboxes that run a harness)")
    h.add_argument("action", choices=["list", "install"])
    h.add_argument("names", nargs="*", metavar="PRESET", help="default: every preset")
    h.add_argument("--dir", default="", help="default: PRORL_HARNESS_DIR")
    h.set_defaults(func=_cmd_harness)
    tm = sub.add_parser("tiny-model", help="build a tiny random model and tokenizer offline")
    tm.add_argument("out", metavar="DIR")
    tm.add_argument("--seed", type=int, default=0)
    tm.add_argument("--chars", action="store_true",
                    help="a character-level tokenizer (45 tokens), for the arith RL loop")
    tm.add_argument("--small", action="store_true",
                    help="hidden 64 (heads of 16) instead of 128 (heads of 32): faster, but "
                    "only the dev server serves it (vLLM's CPU attention needs heads >= 32)")
    tm.add_argument("--tie-embeddings", action="store_true",
                    help="share the output layer with the embeddings (as small Qwen models do)")
    tm.set_defaults(func=_cmd_tiny_model)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=read("log_level"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from prorl_farm.trainer.farm import FarmConnectionError, FarmHTTPError

    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"prorl-farm: {e}", file=sys.stderr)
        return 2
    except (FarmHTTPError, FarmConnectionError) as e:  # the farm's answer, said in a line
        details = getattr(e, "details", None)
        print(f"prorl-farm: {e}" + (f"\n  {details}" if details else ""), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
