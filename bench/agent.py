"""Per-turn overhead of the agent loop.

  python bench/agent.py [--episodes 5] [--turns 20] [--record]

Episodes of ``--turns`` turns, each turn one ``bash`` call (``echo``) in a bwrap sandbox,
against a zero-latency scripted policy over HTTP (the same vLLM route a real server has).
Compared, in the same run, with the sum of what a turn cannot avoid: the policy round trip
(the same prompt sizes, sent alone) plus the tool round trip (``echo`` through the sandbox's
socket, alone). The loop's own cost is tokenising observations, parsing calls, the prefix
check and bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import redis  # noqa: E402
from common import ROOT, machine, pct, private_redis, report  # noqa: F401

sys.path.insert(0, str(ROOT))

from prorl_farm.agent.loop import AgentLimits, run_episode  # noqa: E402
from prorl_farm.agent.parsers import HermesParser  # noqa: E402
from prorl_farm.agent.tools import ToolRunner  # noqa: E402
from prorl_farm.config import load_settings  # noqa: E402
from prorl_farm.context import JobContext  # noqa: E402
from prorl_farm.dev.tiny import build_tokenizer  # noqa: E402
from prorl_farm.llm.clients import client_for  # noqa: E402
from prorl_farm.llm.registry import BackendRegistry, BackendSpec  # noqa: E402
from prorl_farm.sandbox.abstract import SandboxSpec  # noqa: E402
from prorl_farm.sandbox.client import ToolClient  # noqa: E402
from prorl_farm.sandbox.manager import SandboxManager  # noqa: E402
from tests.policy_server import PolicyServer, text_planner  # noqa: E402

CALL = "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": "echo hi"}}) + \
    "\n</tool_call>"


def _in_flight(args, registry, manager, settings) -> float:
    """Episodes/s with ``args.in_flight`` episodes running at once in one process."""
    import threading

    boxes = [manager.start(SandboxSpec()) for _ in range(args.in_flight)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        client = ToolClient(boxes[i].socket)
        ctx = JobContext(job_id=f"flight-{i}", batch_id="bench", stage="run", token="t",
                         node="bench", instance={}, sampling={}, backends=registry,
                         sandboxes=manager, settings=settings)
        try:
            _, ep = run_episode(ctx, [{"role": "user", "content": "[case:echo] go"}],
                                ["bash"], HermesParser(),
                                AgentLimits(max_turns=args.flight_turns,
                                            max_tokens_per_turn=64, max_total_tokens=10**6),
                                ToolRunner(client, 30.0))
            assert ep.turns == args.flight_turns, ep.stats()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            registry.release(f"flight-{i}")
            client.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.in_flight)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for sb in boxes:
        manager.stop(sb)
    if errors:
        raise errors[0]
    return args.in_flight / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--in-flight", type=int, default=200,
                    help="episodes run at once for the throughput figure")
    ap.add_argument("--flight-turns", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="prorl-bench-agent-"))
    sandbox_root = Path(f"/tmp/prs-bench-agent-{int(time.time())}")
    try:
        build_tokenizer(tmp, corpus_bytes=300_000)
        server = PolicyServer(planner=text_planner(str(tmp), {"echo": [CALL]}))
        with private_redis() as url:
            r = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
                url, max_connections=args.in_flight + 16, decode_responses=True))
            settings = load_settings({"PRORL_REDIS_URL": url})
            registry = BackendRegistry(r)
            registry.register(BackendSpec(url=server.url, kind="vllm", model="bench",
                                          tokenizer=str(tmp), capacity=1000))
            manager = SandboxManager(r, "bench", "bwrap", root=str(sandbox_root),
                                     max_sandboxes=args.in_flight + 8)
            turn_s, prompts = [], []
            for e in range(args.episodes):
                sb = manager.start(SandboxSpec())
                client = ToolClient(sb.socket)
                ctx = JobContext(job_id=f"bench-{e}", batch_id="bench", stage="run",
                                 token="t", node="bench", instance={}, sampling={},
                                 backends=registry, sandboxes=manager, settings=settings)
                limits = AgentLimits(max_turns=args.turns, max_tokens_per_turn=64,
                                     max_total_tokens=10**6)
                t0 = time.perf_counter()
                traj, ep = run_episode(ctx, [{"role": "user", "content": "[case:echo] go"}],
                                       ["bash"], HermesParser(), limits,
                                       ToolRunner(client, 10.0))
                turn_s.append((time.perf_counter() - t0) / ep.turns)
                assert ep.turns == args.turns and ep.calls == {"bash": args.turns}, ep.stats()
                prompts += server.prompts[f"bench-{e}"]
                registry.release(f"bench-{e}")
                client.close()
                manager.stop(sb)
            # The floor, alone: the same prompts to the policy, and echo through a sandbox.
            policy_s = []
            llm = client_for("vllm", server.url, "bench", timeout_s=10.0)  # the farm's client
            for prompt in prompts:
                t0 = time.perf_counter()
                llm.generate(prompt, {"max_tokens": 64})
                policy_s.append(time.perf_counter() - t0)
            sb = manager.start(SandboxSpec())
            client = ToolClient(sb.socket)
            tool_s = []
            for _ in range(len(prompts)):
                t0 = time.perf_counter()
                client.call("bash", command="echo hi", timeout_s=10.0)
                tool_s.append(time.perf_counter() - t0)
            client.close()
            manager.stop(sb)
            throughput = _in_flight(args, registry, manager, settings)
        server.kill()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(sandbox_root, ignore_errors=True)
    floor = pct(policy_s, 50) + pct(tool_s, 50)
    loop = pct(turn_s, 50)
    lines = [
        f"### agent — {date.today()} — {machine()}", "",
        f"{args.episodes} episodes x {args.turns} turns, one `bash` `echo` call per turn, "
        "scripted zero-latency policy over HTTP, bwrap sandbox:", "",
        "| what | p50 (ms) | p99 (ms) |", "|---|---|---|",
        f"| agent loop, per turn | {loop * 1e3:.2f} | {pct(turn_s, 99) * 1e3:.2f} |",
        f"| policy round trip alone (same prompts) | {pct(policy_s, 50) * 1e3:.2f} | "
        f"{pct(policy_s, 99) * 1e3:.2f} |",
        f"| tool round trip alone (`echo`) | {pct(tool_s, 50) * 1e3:.2f} | "
        f"{pct(tool_s, 99) * 1e3:.2f} |", "",
        f"Per-turn time / (policy + tool round trips): **{loop / floor:.2f}x**.", "",
        f"{args.in_flight} episodes in flight at once ({args.flight_turns} turns each, one "
        f"`echo` per turn, each in its own bwrap sandbox, sandboxes started beforehand): "
        f"**{throughput:.1f} episodes/s** ({throughput * args.flight_turns:.0f} turns/s).", "",
    ]
    report(lines, args.record)


if __name__ == "__main__":
    main()
