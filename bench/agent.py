"""Per-turn overhead of the agent loop.

  python bench/agent.py [--episodes 9] [--turns 20] [--record]

Episodes of ``--turns`` turns, each turn one ``bash`` call (``echo``) in a bwrap sandbox,
against a zero-latency scripted policy over HTTP (the same vLLM route a real server has).
Compared with the sum of what a turn cannot avoid: the policy round trip (the episode's own
prompts, sent without the loop) plus the tool round trip (``echo`` through a sandbox's
socket), each timed alone, alternating as in an episode. The floor is measured right after
each episode, so drift in the machine's speed lands on both sides; the ratio reported is
the median of the episodes' ratios. The loop's own cost is tokenising observations, parsing
calls, the prefix check and bookkeeping.
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
from prorl_farm.llm.backends import client_for  # noqa: E402
from prorl_farm.llm.registry import BackendRegistry, BackendSpec  # noqa: E402
from prorl_farm.sandbox.abstract import SandboxSpec  # noqa: E402
from prorl_farm.sandbox.connection import ToolConnection  # noqa: E402
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
        client = ToolConnection(boxes[i].socket)
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
    ap.add_argument("--episodes", type=int, default=9)
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
            turn_s, policy_s, tool_s, ratios, in_llm, in_tool = [], [], [], [], [], []
            llm = client_for("vllm", server.url, "bench", timeout_s=10.0)  # the farm's client
            floor_box = manager.start(SandboxSpec())
            floor_client = ToolConnection(floor_box.socket)
            for e in range(-1, args.episodes):  # -1: a warm-up (tokenizer load), not counted
                sb = manager.start(SandboxSpec())
                client = ToolConnection(sb.socket)
                ctx = JobContext(job_id=f"bench-{e}", batch_id="bench", stage="run",
                                 token="t", node="bench", instance={}, sampling={},
                                 backends=registry, sandboxes=manager, settings=settings)
                limits = AgentLimits(max_turns=args.turns, max_tokens_per_turn=64,
                                     max_total_tokens=10**6)
                t0 = time.perf_counter()
                traj, ep = run_episode(ctx, [{"role": "user", "content": "[case:echo] go"}],
                                       ["bash"], HermesParser(), limits,
                                       ToolRunner(client, 10.0))
                turn = (time.perf_counter() - t0) / ep.turns
                assert ep.turns == args.turns and ep.calls == {"bash": args.turns}, ep.stats()
                registry.release(f"bench-{e}")
                client.close()
                manager.stop(sb)
                # The floor, right after, without the loop: the episode's prompts to the
                # policy, each followed by an echo through a sandbox, in the loop's order
                # (each process wakes as often as in an episode), each timed on its own.
                prompts = server.prompts[f"bench-{e}"]
                policy = tool = 0.0
                for prompt in prompts:
                    t0 = time.perf_counter()
                    llm.generate(prompt, {"max_tokens": 64})
                    t1 = time.perf_counter()
                    floor_client.call("bash", command="echo hi", timeout_s=10.0)
                    policy += t1 - t0
                    tool += time.perf_counter() - t1
                policy /= len(prompts)
                tool /= len(prompts)
                if e < 0:
                    continue
                in_llm.append(ep.llm_s / ep.turns)
                in_tool.append(ep.tool_s / ep.turns)
                turn_s.append(turn)
                policy_s.append(policy)
                tool_s.append(tool)
                ratios.append(turn / (policy + tool))
            floor_client.close()
            manager.stop(floor_box)
            throughput = _in_flight(args, registry, manager, settings)
        server.kill()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(sandbox_root, ignore_errors=True)
    def ms(xs: list[float]) -> str:
        return f"{pct(xs, 50) * 1e3:.2f} | {min(xs) * 1e3:.2f} | {max(xs) * 1e3:.2f}"

    lines = [
        f"### agent — {date.today()} — {machine()}", "",
        f"{args.episodes} episodes x {args.turns} turns, one `bash` `echo` call per turn, "
        "scripted zero-latency policy over HTTP, bwrap sandbox; each episode followed by "
        "its floor (its own prompts to the policy, each followed by an `echo` call, each timed "
        "alone, without the loop). Mean per turn within an episode, then across episodes:", "",
        "| what | median (ms) | best (ms) | worst (ms) |", "|---|---|---|---|",
        f"| agent loop, per turn | {ms(turn_s)} |",
        f"| policy round trip alone (same prompts) | {ms(policy_s)} |",
        f"| tool round trip alone (`echo`) | {ms(tool_s)} |",
        f"| inside the loop: its LLM calls | {ms(in_llm)} |",
        f"| inside the loop: its tool calls | {ms(in_tool)} |", "",
        f"Per-turn time / (policy + tool round trips), median over episodes: "
        f"**{pct(ratios, 50):.2f}x** (range {min(ratios):.2f}–{max(ratios):.2f}x).", "",
        f"{args.in_flight} episodes in flight at once ({args.flight_turns} turns each, one "
        f"`echo` per turn, each in its own bwrap sandbox, sandboxes started beforehand): "
        f"**{throughput:.1f} episodes/s** ({throughput * args.flight_turns:.0f} turns/s).", "",
    ]
    report(lines, args.record)


if __name__ == "__main__":
    main()
