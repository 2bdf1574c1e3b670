"""Load for bench/gateway.py, in a process of its own: many harness episodes at once, each a
kept-alive HTTP/1.1 connection making its calls one after another with a tool's time in
between, against the gateway (Chat Completions, the conversation resent whole each call) or
straight to the backend (token-in, prompts of the lengths the gateway's calls had). Prints
one JSON object: the seconds of each call, the wall time, the errors.

Also the zero-latency scripted backend (``serve``): an asyncio HTTP server that answers
vLLM's token route at once with the same planned reply to every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]


async def _exchange(reader, writer, request: bytes) -> tuple[int, bytes]:
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


def _request(path: str, doc: dict, key: str) -> bytes:
    body = json.dumps(doc).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


async def episode(host: str, port: int, key: str, args, times: list, lengths: list,
                  errors: list, order: list) -> None:
    """One episode on its own connection to ``port`` (a gateway process's, or the
    backend's), as the job of ``key``."""
    await asyncio.sleep(random.uniform(0, args.think))  # arrivals spread over a tool's time
    reader, writer = await asyncio.open_connection(host, port)
    messages = [{"role": "user", "content": "[case:loop] go"}]
    try:
        for k in range(args.calls):
            if args.mode == "gateway":
                req = _request("/v1/chat/completions", {
                    "model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 64},
                    key)
            else:
                req = _request("/inference/v1/generate", {
                    "model": "tiny", "token_ids": [7] * args.lengths[k], "sampling_params": {
                        "max_tokens": 64, "logprobs": 0, "skip_special_tokens": False,
                        "temperature": 1.0}}, key)
            t0 = time.perf_counter()
            status, body = await _exchange(reader, writer, req)
            times.append(time.perf_counter() - t0)
            order.append(k)
            if status != 200:
                errors.append(f"{status}: {body[:200]!r}")
                return
            if args.mode == "gateway":
                doc = json.loads(body)
                lengths.append((k, doc["usage"]["prompt_tokens"]))
                msg = doc["choices"][0]["message"]
                messages.append(msg)
                for call in msg.get("tool_calls") or []:
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": "hi " * 20})
            if args.think:
                await asyncio.sleep(random.uniform(0.5, 1.5) * args.think)
    except (OSError, asyncio.IncompleteReadError) as e:
        errors.append(repr(e))
    finally:
        writer.close()


async def load(args) -> dict:
    keys = json.loads(open(args.keys).read())  # [port, key] per episode
    host = args.host
    times: list[float] = []
    lengths: list = []
    errors: list[str] = []
    order: list[int] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(episode(host, port, key, args, times, lengths, errors, order)
                           for port, key in keys))
    wall = time.perf_counter() - t0
    by_call: dict[int, list[int]] = {}
    for k, n in lengths:
        by_call.setdefault(k, []).append(n)
    return {"times": times, "call": order, "wall_s": wall, "errors": errors,
            "lengths": [max(by_call[k]) for k in sorted(by_call)]}


# -- the zero-latency backend -----------------------------------------------------------


async def serve(port: int, reply: list[int]) -> None:
    body = json.dumps({"choices": [{
        "index": 0, "token_ids": reply, "finish_reason": "stop",
        "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in reply]},
        "weight_versions": [{"version": None, "start": 0, "end": len(reply)}]}]}).encode()
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=2048)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    lo = sub.add_parser("load")
    lo.add_argument("--host", default="127.0.0.1")
    lo.add_argument("--keys", required=True)
    lo.add_argument("--mode", choices=["gateway", "straight"], required=True)
    lo.add_argument("--calls", type=int, default=3)
    lo.add_argument("--think", type=float, default=0.5)
    lo.add_argument("--lengths", type=json.loads, default=[])
    sv = sub.add_parser("serve")
    sv.add_argument("--port", type=int, required=True)
    sv.add_argument("--reply", type=json.loads, required=True)
    args = ap.parse_args()
    if args.what == "serve":
        asyncio.run(serve(args.port, args.reply))
        return
    out = asyncio.run(load(args))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
