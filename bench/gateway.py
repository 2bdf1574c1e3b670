"""The model gateway's cost per call: a 20-turn tool-calling conversation through the
gateway (the ``openai`` SDK as the client, the capture rendering and merging each call)
against the same token-in calls straight to the backend, in one run, with a scripted
zero-latency policy; then, at scale, 512 harness episodes in flight at once through the
gateways of one and of two RUN pool processes (each episode a kept-alive connection in a
load process of its own, a tool's time between its calls: 0.5, 1 and 2 s) against the same
episodes' calls straight to the backend (token-in, the same prompt lengths), the most calls
a second the gateways serve, and the capture's cost per call as a conversation grows to 64k
tokens.

    .venv/bin/python bench/gateway.py [--turns 20] [--episodes 512] [--think 0.5 1 2]
                                      [--processes 1 2] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
from tests.farm import free_port  # noqa: E402
from tests.policy_server import PolicyServer, text_planner  # noqa: E402

LOAD = str(Path(__file__).with_name("gateway_load.py"))

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


def _reply_ids(tok_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    return tok.encode(CALL, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]


def _load(keys: list, mode: str, calls: int, think: float,
          lengths: list[int] | None = None) -> dict:
    """Episodes from a load process of their own: one per ``[port, key]`` of ``keys``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(keys, f)
    try:
        out = subprocess.run([sys.executable, LOAD, "load", "--keys", f.name, "--mode", mode,
                              "--calls", str(calls), "--think", str(think),
                              "--lengths", json.dumps(lengths or [])],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    return json.loads(out.stdout)


def serve_gateway(tok_dir: str, url: str, jobs: int) -> None:
    """A gateway process, as a RUN pool process serves its jobs' gateways: ``jobs`` jobs
    opened, their port and keys printed, served until stdin closes."""
    load_chat_tokens(tok_dir)  # the pool process's tokenizer, loaded (and frozen) once
    gateway = GatewayServer()
    keys = [gateway.open_job(_job(tok_dir, url)) for _ in range(jobs)]
    print(json.dumps({"port": gateway.server_address[1], "keys": keys}), flush=True)
    sys.stdin.read()
    gateway.stop()


def at_scale(tok_dir: str, episodes: int, calls: int, thinks: list[float],
             processes: int) -> dict:
    """Episodes in flight through the gateways of ``processes`` pool processes (each its
    share of the jobs), for each tool time of ``thinks``, against the same calls straight
    to a zero-latency backend (a process of its own); and the most gateway calls a second."""
    port = free_port()
    backend = subprocess.Popen([sys.executable, LOAD, "serve", "--port", str(port),
                                "--reply", json.dumps(_reply_ids(tok_dir))],
                               stdout=subprocess.PIPE, text=True)
    gateways = []
    out: dict = {"via": {}, "straight": {}}
    try:
        assert backend.stdout.readline().strip() == "ready"
        url = f"http://127.0.0.1:{port}"
        warm, flat = 8, 64
        need = {"warm": warm, "flat": flat, **{think: episodes for think in thinks}}
        keys: dict = {name: [] for name in need}
        for i in range(processes):
            mine = {name: n // processes + (i < n % processes) for name, n in need.items()}
            gw = subprocess.Popen([sys.executable, __file__, "--serve-gateway", tok_dir, url,
                                   str(sum(mine.values()))],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            gateways.append(gw)
            doc = json.loads(gw.stdout.readline())
            opened = [[doc["port"], k] for k in doc["keys"]]
            for name, n in mine.items():
                keys[name] += opened[:n]
                del opened[:n]
        _load(keys["warm"], "gateway", 3, 0.05)
        for think in thinks:
            via = out["via"][think] = _load(keys[think], "gateway", calls, think)
            out["straight"][think] = _load([[port, "-"]] * episodes, "straight", calls,
                                           think, via["lengths"])
        out["flat_out"] = _load(keys["flat"], "gateway", 30, 0.0)
    finally:
        for gw in gateways:
            gw.stdin.close()
            gw.wait(timeout=30)
        backend.kill()
        backend.wait()
    return out


def capture_cost(tok_dir: str, sizes=(1_000, 8_000, 32_000, 64_000)) -> dict[int, float]:
    """The capture's own time per call (prompt: the conversation normalised, compared, the
    new messages' glue rendered; record: the reply decoded and parsed) as a conversation of
    tool calls with ~500-token outputs grows to each size; ms, the mean of 10 calls there."""
    chat = load_chat_tokens(tok_dir)
    reply = _reply_ids(tok_dir)
    cap = Capture(chat, get_parser("hermes"))
    messages = [{"role": "user", "content": "[case:loop] go"}]
    output = " ".join(f"line {i}: ok" for i in range(120))
    out: dict[int, float] = {}
    pending = list(sizes)
    times: list[float] = []
    while pending:
        t0 = time.perf_counter()
        sent = cap.prompt(messages, TOOLS)
        got = cap.record(sent, reply, [-0.5] * len(reply), "stop", "b0", 0, "raw_logprobs")
        dt = time.perf_counter() - t0
        length = len(sent)
        if length >= pending[0]:
            times.append(dt)
            if len(times) == 10:
                out[pending.pop(0)] = 1000 * statistics.mean(times)
                times = []
        messages.append({"role": "assistant", "content": got.content, "tool_calls": [
            {"id": f"c{len(messages)}", "type": "function", "function": {
                "name": c["function"]["name"],
                "arguments": json.dumps(c["function"]["arguments"])}}
            for c in got.tool_calls]})
        messages.append({"role": "tool", "tool_call_id": f"c{len(messages)}",
                         "content": output})
    assert len(cap.segments) == 1, "the conversation split"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--episodes", type=int, default=512)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--think", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                    help="tool times between an episode's calls, seconds (one run each)")
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2],
                    help="pool processes serving the episodes' gateways (one run each)")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--serve-gateway", nargs=3, metavar=("TOKENIZER", "BACKEND", "JOBS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_gateway:
        tok_dir, url, jobs = args.serve_gateway
        serve_gateway(tok_dir, url, int(jobs))
        return
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
        finally:
            gateway.stop()
            policy.kill()
        scales = {n: at_scale(tmp, args.episodes, args.calls, args.think, n)
                  for n in args.processes}
        flat = capture_cost(tmp)
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
    ]
    longest = max(max(sc["via"][t]["lengths"]) for sc in scales.values() for t in args.think)
    lines += [
        f"**At scale**: {args.episodes} episodes in flight, each a kept-alive connection "
        f"making {args.calls} calls (the conversation resent whole, prompts up to {longest} "
        "tokens) with a tool's time between them (±50%), from a load process of its own, "
        "through the gateways of one or more RUN pool processes (`PRORL_RUN_PROCESSES`; each "
        "serves its share of the jobs); against the same calls straight to the "
        "zero-latency backend (token-in, the same prompt lengths, the same pacing). Load, "
        "backend and gateways share the machine's cores.", "",
        "| RUN processes | tool time s | offered calls/s | gateway calls/s | errors | "
        "gateway p50 / p99 ms | straight p50 / p99 ms | **added p50 / p99 ms** |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, sc in scales.items():
        for think in args.think:
            via, straight = sc["via"][think], sc["straight"][think]
            q = {name: [1000 * pct(r["times"], p) for p in (50, 99)]
                 for name, r in (("via", via), ("straight", straight))}
            lines.append(
                f"| {n} | {think:g} | {args.episodes / think:.0f} | "
                f"{len(via['times']) / via['wall_s']:.0f} | "
                f"{len(via['errors']) + len(straight['errors'])} | "
                f"{q['via'][0]:.2f} / {q['via'][1]:.2f} | "
                f"{q['straight'][0]:.2f} / {q['straight'][1]:.2f} | "
                f"**{q['via'][0] - q['straight'][0]:.2f} / "
                f"{q['via'][1] - q['straight'][1]:.2f}** |")
    lines += ["", "Flat out (64 episodes of 30 calls, no time between calls): " + ", ".join(
        f"**{len(sc['flat_out']['times']) / sc['flat_out']['wall_s']:.0f} gateway calls/s** "
        f"with {n} RUN process{'es' if n > 1 else ''} ({len(sc['flat_out']['errors'])} errors)"
        for n, sc in scales.items()) + ".",
        "", "The capture's own cost per call as the conversation grows (ms, in process): "
        + ", ".join(f"{size // 1000}k tokens {ms:.2f}" for size, ms in flat.items()) + ".",
        "",
    ]
    report(lines, args.record)


if __name__ == "__main__":
    main()
