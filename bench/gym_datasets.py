"""Every example dataset nemo-gym 0.7.0 ships, as it comes, through Gym's
``ng_collect_rollouts``, the farm and the environment's own resources server: per
environment its rows, the rows returned with a reward, those valid as Gym's
``BaseVerifyResponse``, and the farm's reward against Gym's own verdict on the same
answers (the recorded model's, and a scripted wrong one), or why it cannot run here.

    .venv/bin/python bench/gym_datasets.py [--env NAME ...] [--limit 8] [--record]

A real farm (private redis-server, the three pools, the API under gunicorn); the policy
replays each row's recorded rollout (tests/gym_datasets.py) with the tiny model's tokenizer;
Gym's head server (its own code) serves a config naming `prorl-farm gym` as the agent, which
is started for each environment with ``--resources-server`` on that environment's server.
Also the farm's own math grader against Gym's math_with_judge verifier on the same answers.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, private_redis, report  # noqa: E402
from bench.pipeline import Processes, farm_env, start_farm_api, wait_for  # noqa: E402
from prorl_farm.supervisor import free_port  # noqa: E402
from prorl_farm.trainer import FarmClient  # noqa: E402
from tests import gym_datasets as gd  # noqa: E402
from tests.policy_server import PolicyServer  # noqa: E402

POOLS = {"init": 8, "run": 16, "eval": 8}
AGENT = "prorl_farm_agent"


def head_config(tmp: Path, head_port: int, gym_port: int) -> Path:
    config = tmp / "farm.yaml"
    config.write_text(f"""head_server:
  host: 127.0.0.1
  port: {head_port}
{AGENT}:
  responses_api_agents:
    prorl_farm:
      host: 127.0.0.1
      port: {gym_port}
{AGENT}_environment_server:
  environment_servers:
    legacy_agent:
      host: 127.0.0.1
      port: {gym_port}
      agent_server:
        type: responses_api_agents
        name: {AGENT}
      max_concurrent_episodes: null
      queue_timeout_seconds: null
      default_episode_timeout_seconds: 21600
      cleanup_timeout_seconds: 180
""")
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", action="append", help="only these environments")
    ap.add_argument("--limit", type=int, default=4, help="rows per environment")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    # Stopped, it stops what it started (each server is a process group of its own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if not gd.GYM_PYTHON.exists():
        sys.exit("needs NeMo Gym: make gym")
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-gym-datasets-"))
    procs = Processes()
    results: list[gd.EnvResult] = []
    t0 = time.monotonic()
    try:
        from prorl_farm.dev.tiny import build_tiny_model

        model = build_tiny_model(tmp / "model")
        replay = gd.Replay(str(model))
        policy = PolicyServer(planner=lambda p, n: replay(p, n) or ([replay.end], "stop"))
        with private_redis() as url:
            base = start_farm_api(procs, url, POOLS, tmp)
            farm = FarmClient(base)
            env = farm_env(url, POOLS, events=False)
            farm.register_backend(policy.url, "vllm", "tiny", str(model), capacity=32)
            head_port, gym_port = free_port(), free_port()
            config = head_config(tmp, head_port, gym_port)
            with open(tmp / "head.log", "ab") as log:  # in tmp: Gym writes beside it
                procs.procs.append(subprocess.Popen(
                    [str(gd.GYM_PYTHON), gd.GYM_SIDE, "head", f"+config_paths=[{config}]"],
                    cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            wait_for(lambda: gd._up(f"http://127.0.0.1:{head_port}"), 120, "Gym's head")

            def start_gym(server: str, grader: str = ""):
                cmd = [sys.executable, "-m", "prorl_farm.cli", "gym", "--port", str(gym_port),
                       "--farm", base]
                cmd += ["--resources-server", server] if server else ["--grader", grader]
                with open(tmp / "gym.log", "ab") as log:
                    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                wait_for(lambda: gd._up(f"http://127.0.0.1:{gym_port}/healthz"), 60, "gym")

                def stop():
                    from tests.farm import stop_process

                    stop_process(proc)
                return stop

            for name in args.env or gd.environments():
                r = gd.run_env(name, replay, start_gym, config, tmp, free_port(),
                               f"http://127.0.0.1:{gym_port}", limit=args.limit)
                results.append(r)
                print(r.line(), flush=True)
                for d in r.disagreements[:3]:
                    print("   disagrees:", d, flush=True)
            if not args.env or "math_with_judge" in args.env:
                results.append(math_grader(replay, start_gym, config, tmp, args.limit))
                print(results[-1].line(), flush=True)
        policy.kill()
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    ran = [r for r in results if r.rows]
    agree = sum(r.right[0] + r.wrong[0] for r in ran)
    compared = sum(r.right[1] + r.wrong[1] for r in ran)
    lines = [
        f"### gym datasets — {date.today()} — {machine()}", "",
        f"The example datasets of nemo-gym 0.7.0 (`resources_servers/*/data/example.jsonl`, "
        f"{len(results)} environments, up to {args.limit} rows each: those with a recorded "
        "rollout to replay) through Gym's `ng_collect_rollouts`, `prorl-farm gym "
        "--resources-server` and each environment's own server (Gym's code). **right**: the "
        "recorded model's answers replayed through the farm, the farm's reward against Gym's "
        "own verdict on the same answer (its server's /seed_session + /verify called directly "
        "for rows without tools; the recorded reward for rows with tools); **wrong**: a "
        f"scripted wrong answer ({gd.WRONG!r}, posted to `/run` as the collector posts) "
        "against its server's verdict. **earned**: the "
        "farm's mean reward in the right pass. An environment that cannot run here says why "
        f"(the farm's and Gym's own words). {len(ran)} ran; the farm agreed with Gym on "
        f"**{agree} of {compared}** answers. {time.monotonic() - t0:.0f} s in all.", "",
        "| environment | rows | returned | valid | right | wrong | earned | why not / notes |",
        "|---|---|---|---|---|---|---|---|",
        *[r.line() for r in results], "",
    ]
    report(lines, args.record)


def math_grader(replay, start_gym, config, tmp, limit) -> gd.EnvResult:
    """math_with_judge's rows graded by the farm's own math grader (``--grader math``)
    against Gym's math_with_judge verifier on the same answers."""
    res = gd.EnvResult("math_with_judge (the farm's math grader)")
    got, why = gd.cases("math_with_judge", limit)
    server = gd.EnvServer("math_with_judge", free_port(), tmp / "mwj-server.log")
    try:
        why = why or server.wait()
        if why:
            res.reason = why
            return res
        replay.cases = got
        stop = start_gym("", grader="math")
        try:
            res.rows = len(got)
            for wrong in (False, True):
                replay.wrong = wrong
                results, failures, why = gd.collect(config, [c.row for c in got], tmp,
                                                    f"mwj-{wrong}")
                res.reason = res.reason or why
                agree = compared = 0
                for case, r in gd._match([x for x in results if not x.get("mask_sample")],
                                         got):
                    # Gym's verdict on the farm's own final answer.
                    final = [i for i in r["response"]["output"] if i["type"] == "message"]
                    text = final[-1]["content"][0]["text"] if final else ""
                    want, _ = server.verdict(case.row, gd.message_response(text))
                    if want is None:
                        continue
                    compared += 1
                    agree += abs(r["reward"] - want) < 1e-9
                    if abs(r["reward"] - want) >= 1e-9:
                        res.disagreements.append((wrong, text[-80:], r["reward"], want))
                if wrong:
                    res.wrong = (agree, compared)
                else:
                    res.right = (agree, compared)
                    scored = [x for x in results if not x.get("mask_sample")]
                    res.returned = len(scored)
                    res.valid = gd.valid(tmp / "mwj-False-rollouts.jsonl")
                    res.earned = sum(x["reward"] for x in scored) / max(1, len(scored))
        finally:
            stop()
    finally:
        server.stop()
    return res


if __name__ == "__main__":
    main()
