"""The model gateway's cost per call: a 20-turn tool-calling conversation through the
gateway (the ``openai`` SDK as the client, the capture rendering and merging each call)
against the same token-in calls straight to the backend, in one run, with a scripted
zero-latency policy; then many harness episodes in flight at once through one gateway.

    .venv/bin/python bench/gateway.py [--turns 20] [--episodes 200] [--record]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

from common import ROOT, machine, pct, report  # noqa: F401

sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from prorl_farm.agent.parsers import get_parser  # noqa: E402
from prorl_farm.agent.trajectory import load_chat_tokens  # noqa: E402
from prorl_farm.dev.tiny import build_tokenizer  # noqa: E402
from prorl_farm.gateway.capture import Capture  # noqa: E402
from prorl_farm.gateway.server import GatewayServer, JobGateway, Sampled  # noqa: E402
from prorl_farm.llm.backends.vllm import VLLMClient  # noqa: E402
from tests.policy_server import PolicyServer, text_planner  # noqa: E402

CALL = "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": "echo hi"}}) + \
    "\n</tool_call>"
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]


def _job(tok_dir: str, url: str) -> JobGateway:
    client = VLLMClient(url, "tiny")

    def sampler(prompt, sampling):
        return Sampled(client.generate(prompt, sampling), "b0", 0, "raw_logprobs")

    return JobGateway("bench", Capture(load_chat_tokens(tok_dir), get_parser("hermes")),
                      sampler, {"temperature": 1.0}, "tiny", max_tokens=64)


def episode(gateway: GatewayServer, tok_dir: str, url: str, turns: int) -> tuple[list, dict]:
    """One harness conversation of ``turns`` calls; (seconds per call, capture stats)."""
    key = gateway.open_job(_job(tok_dir, url))
    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "[case:loop] go"}]
    times = []
    try:
        for _ in range(turns):
            t0 = time.perf_counter()
            out = sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
            times.append(time.perf_counter() - t0)
            msg = out.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "hi"})
    finally:
        sdk.close()
    return times, gateway.close_job(key).result()["capture"]


def plain(gateway: GatewayServer, tok_dir: str, url: str, turns: int) -> list[float]:
    """The same conversation through the gateway with a bare HTTP/1.1 client (kept-alive
    connection, JSON in and out): the gateway's own cost without the SDK's."""
    import http.client

    key = gateway.open_job(_job(tok_dir, url))
    host, port = gateway.server_address[:2]
    conn = http.client.HTTPConnection(host, port)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    messages, times = [{"role": "user", "content": "[case:loop] go"}], []
    for _ in range(turns):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "tiny", "messages": messages, "tools": TOOLS}), headers)
        doc = json.loads(conn.getresponse().read())
        times.append(time.perf_counter() - t0)
        msg = doc["choices"][0]["message"]
        messages.append(msg)
        for call in msg.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "hi"})
    conn.close()
    gateway.close_job(key)
    return times


def direct(tok_dir: str, url: str, prompts: list[list[int]]) -> list[float]:
    """The same prompts as token-in calls straight to the backend."""
    client = VLLMClient(url, "tiny")
    times = []
    for prompt in prompts:
        t0 = time.perf_counter()
        client.generate(prompt, {"temperature": 1.0, "max_tokens": 64})
        times.append(time.perf_counter() - t0)
    client.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(Path(tmp), corpus_bytes=300_000)
        policy = PolicyServer(planner=text_planner(tmp, {"loop": [CALL]}))
        gateway = GatewayServer()
        try:
            episode(gateway, tmp, policy.url, 3)  # warm-up
            policy.prompts.clear()
            via, stats = episode(gateway, tmp, policy.url, args.turns)
            prompts = [p for ps in policy.prompts.values() for p in ps]
            straight = direct(tmp, policy.url, prompts)
            bare = plain(gateway, tmp, policy.url, args.turns)
            results, errors = [], []

            def run_one():
                try:
                    results.append(episode(gateway, tmp, policy.url, 3)[1])
                except Exception as e:  # noqa: BLE001 - counted
                    errors.append(repr(e))

            t0 = time.monotonic()
            threads = [threading.Thread(target=run_one) for _ in range(args.episodes)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            many_s = time.monotonic() - t0
        finally:
            gateway.stop()
            policy.kill()
    p50_via, p50_direct = statistics.median(via), statistics.median(straight)
    lines = [
        f"### gateway — {date.today()} — {machine()}", "",
        f"A {args.turns}-call tool-calling conversation through the gateway (the `openai` SDK "
        "as the client; each call rendered, merged into the job's segment and sampled "
        "token-in) against the same prompts sent token-in straight to the backend, in one "
        "run; a scripted policy with no latency of its own, so the figures are the "
        "gateway's and the client's own cost.", "",
        "| path | p50 ms | p90 ms |", "|---|---|---|",
        f"| through the gateway, the `openai` SDK | {1000 * p50_via:.2f} | "
        f"{1000 * pct(via, 90):.2f} |",
        f"| through the gateway, a bare HTTP client | {1000 * statistics.median(bare):.2f} | "
        f"{1000 * pct(bare, 90):.2f} |",
        f"| straight to the backend | {1000 * p50_direct:.2f} | "
        f"{1000 * pct(straight, 90):.2f} |", "",
        f"Ratio at p50: **{statistics.median(bare) / p50_direct:.2f}x** with a bare client, "
        f"{p50_via / p50_direct:.2f}x with the SDK (its own request handling, a few ms a "
        "call, is most of that; against a real model's tens of ms per call both approach "
        f"1). Capture: {stats['calls']} calls, {stats['merged']} merged, "
        f"{stats['segments']} segment(s).", "",
        f"{args.episodes} episodes of 3 calls in flight at once through one gateway: "
        f"{len(results)} finished, {len(errors)} failed, in {many_s:.1f} s"
        + (f" (first error: {errors[0]})" if errors else "") + ".", "",
    ]
    report(lines, args.record)


if __name__ == "__main__":
    main()
