"""OpenAI Chat Completions as the gateway speaks it: the request read and checked (errors in
OpenAI's own shape, naming the parameter), the job's sampling put over the harness's, and
the answer built from what the policy sampled, whole or as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from prorl_farm.errors import FarmError
from prorl_farm.gateway.capture import Reply

# Sampling fields a harness may ask for, by their name in the request -> (the farm's name,
# the range a value must be in).
REQUEST_SAMPLING = {"temperature": ("temperature", 0, 2), "top_p": ("top_p", 0, 1),
                    "seed": ("seed", 0, 2**63 - 1), "max_tokens": ("max_tokens", 1, 1 << 20),
                    "max_completion_tokens": ("max_tokens", 1, 1 << 20),
                    "presence_penalty": ("presence_penalty", -2, 2),
                    "frequency_penalty": ("frequency_penalty", -2, 2)}


class GatewayError(FarmError, ValueError):
    """A call refused: its HTTP status, OpenAI error type and code, and the parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code
        self.retry_after = retry_after  # seconds, for a 429/529: the Retry-After header

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    tools: list[dict] | None
    tool_choice: object
    stream: bool
    include_usage: bool
    sampling: dict = field(default_factory=dict)  # what the harness asked, farm names
    stop: list[str] = field(default_factory=list)
    thinking: bool = False  # Anthropic: answer the reasoning as a thinking block
    show_thinking: bool = True  # its text too (not with ``display: omitted``)


def checked_number(body: dict, name: str, lo: float, hi: float):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise GatewayError(400, f"'{name}' must be a number from {lo} to {hi}", name)
    return value


def parse_chat(body) -> ChatRequest:
    """A Chat Completions request, checked; GatewayError (400) names what is wrong."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user",
                                                            "assistant", "tool"):
            raise GatewayError(400, f"messages[{i}]: 'role' must be system, developer, user, "
                               "assistant or tool", f"messages[{i}].role")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or any(
            not isinstance(t, dict) or t.get("type") != "function" or
            not isinstance(t.get("function"), dict) or not t["function"].get("name")
            for t in tools)):
        raise GatewayError(400, "'tools' must be an array of {type: function, function: "
                           "{name, parameters}}", "tools")
    if body.get("n", 1) != 1:
        raise GatewayError(400, "only n=1 is served", "n")
    sampling = {}
    for name, (farm_name, lo, hi) in REQUEST_SAMPLING.items():
        value = checked_number(body, name, lo, hi)
        if value is not None:
            sampling[farm_name] = value
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise GatewayError(400, "'stop' must be a string or an array of strings", "stop")
    options = body.get("stream_options") or {}
    messages = [dict(m, role="system") if m.get("role") == "developer" else m
                for m in messages]
    return ChatRequest(model=str(body.get("model") or ""), messages=messages, tools=tools,
                       tool_choice=body.get("tool_choice", "auto"),
                       stream=bool(body.get("stream")),
                       include_usage=bool(options.get("include_usage")), sampling=sampling,
                       stop=stop)


def merge_sampling(job: dict, asked: dict, max_tokens_cap: int) -> tuple[dict, list[dict]]:
    """The sampling of a call: the job's where it says (the trainer's), the harness's where
    the job leaves a field unset; each harness value not taken is recorded."""
    out, overridden = dict(job), []
    for name, value in asked.items():
        if name == "max_tokens":
            continue
        if job.get(name) is None:
            out[name] = value
        elif job[name] != value:
            overridden.append({"field": name, "asked": value, "used": job[name]})
    wanted = asked.get("max_tokens")
    out["max_tokens"] = min(v for v in (wanted, job.get("max_tokens"), max_tokens_cap) if v)
    if wanted and wanted > out["max_tokens"]:
        overridden.append({"field": "max_tokens", "asked": wanted, "used": out["max_tokens"]})
    return out, overridden


def _tool_calls(reply: Reply, call_ids: list[str]) -> list[dict]:
    return [{"id": cid, "type": "function", "function": {
        "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
        for cid, c in zip(call_ids, reply.tool_calls)]


def chat_response(req: ChatRequest, reply: Reply, prompt_tokens: int, model: str) -> dict:
    call_ids = [f"call_{uuid.uuid4().hex[:24]}" for _ in reply.tool_calls]
    message: dict = {"role": "assistant", "content": reply.content or None}
    if reply.reasoning:  # as vLLM's reasoning parsers answer it
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply, call_ids)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": reply.finish_reason}],
            "usage": _usage(prompt_tokens, reply)}


def _usage(prompt_tokens: int, reply: Reply) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(reply.token_ids),
            "total_tokens": prompt_tokens + len(reply.token_ids)}


def chat_stream(req: ChatRequest, reply: Reply, prompt_tokens: int, model: str
                ) -> Iterator[bytes]:
    """The answer as Chat Completions server-sent events: the role, the content in pieces,
    each tool call (its name, then its arguments in deltas), the finish reason, the usage
    when asked (``stream_options.include_usage``), and ``[DONE]``."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}

    def event(delta: dict, finish=None, **extra) -> bytes:
        chunk = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}], **extra}
        if req.include_usage:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk)}\n\n".encode()

    yield event({"role": "assistant", "content": ""})
    text = reply.content
    for i in range(0, len(text), 16):
        yield event({"content": text[i:i + 16]})
    for k, call in enumerate(_tool_calls(reply, [f"call_{uuid.uuid4().hex[:24]}"
                                                 for _ in reply.tool_calls])):
        yield event({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"],
                                                  "arguments": ""}}]})
        args = call["function"]["arguments"]
        for i in range(0, len(args), 16):
            yield event({"tool_calls": [{"index": k, "function": {"arguments":
                                                                  args[i:i + 16]}}]})
    yield event({}, reply.finish_reason)
    if req.include_usage:
        usage = {**base, "choices": [], "usage": _usage(prompt_tokens, reply)}
        yield f"data: {json.dumps(usage)}\n\n".encode()
    yield b"data: [DONE]\n\n"
