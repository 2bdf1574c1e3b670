"""Anthropic Messages as the gateway speaks it: the request read and checked, its content
blocks turned into the chat messages the capture renders (``tool_use`` blocks as tool
calls, ``tool_result`` blocks as tool messages, a mid-conversation ``system`` message as a
system message where Anthropic's placement rule allows one: right after a user message),
and the answer built from what the policy sampled: ``thinking`` (when asked), ``text`` and
``tool_use`` blocks, whole or as Messages stream events.

What Claude Code sends besides is read and let be: ``system`` as text blocks with
``cache_control`` (joined by a newline: a client that splits one prompt into cache blocks
gets it back whole), ``thinking`` (``adaptive``, ``enabled``, ``disabled``; thinking blocks
sent back with their signatures are the model's own reasoning, which the capture keeps as
sampled ids), ``output_config``, ``context_management``, ``metadata``, ``tools`` with
``defer_loading`` (a deferred tool is not in the prompt until the client sends it loaded,
as Anthropic's tool search has it)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

from prorl_farm.gateway.capture import Reply, content_text
from prorl_farm.gateway.openai_api import ChatRequest, GatewayError, checked_number

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
                "abort": "end_turn"}


SYSTEM_JOIN = "\n"  # between the text blocks of ``system`` and of a system message
THINKING = ("adaptive", "enabled", "disabled")


def error_body(error: GatewayError, request_id: str) -> dict:
    """Anthropic's error object: its ``type`` by the status, as the SDKs map them back."""
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "request_too_large", 429: "rate_limit_error",
            529: "overloaded_error"}.get(error.status, "invalid_request_error")
    if error.status >= 500 and error.status != 529:
        kind = "api_error"
    return {"type": "error", "error": {"type": kind, "message": str(error)},
            "request_id": request_id}


def _blocks(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise GatewayError(400, "'content' must be a string or an array of blocks", "content")
    return content


def system_text(system, where: str) -> str:
    """A system prompt's text: a string, or text blocks (``cache_control`` and the like
    let be) joined as one prompt."""
    if isinstance(system, str):
        return system
    if not isinstance(system, list) or any(
            not isinstance(b, dict) or b.get("type") != "text" or
            not isinstance(b.get("text"), str) for b in system):
        raise GatewayError(400, f"{where}: must be a string or an array of text blocks",
                           where)
    return SYSTEM_JOIN.join(b["text"] for b in system)


def _messages(body: dict) -> list[dict]:
    """The conversation as chat messages (system first)."""
    out: list[dict] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": system_text(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages: must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise GatewayError(400, f"messages.{i}.role: must be user, assistant or system",
                               f"messages.{i}.role")
        if role == "system":  # Anthropic's placement rule: right after a user turn
            if not i or messages[i - 1].get("role") != "user":
                raise GatewayError(400, f"messages.{i}: a system message must come right "
                                   "after a user message", f"messages.{i}.role")
            out.append({"role": "system",
                        "content": system_text(m.get("content", ""), f"messages.{i}.content")})
            continue
        blocks = _blocks(m.get("content", ""))
        if m["role"] == "assistant":
            text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
            calls = [{"type": "function", "function": {"name": b.get("name", ""),
                                                       "arguments": b.get("input") or {}}}
                     for b in blocks if b.get("type") == "tool_use"]
            msg: dict = {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        for b in blocks:
            if b.get("type") == "tool_result":
                out.append({"role": "tool", "content": content_text(b.get("content", ""))})
        texts = [b for b in blocks if b.get("type") == "text"]
        if texts:
            out.append({"role": "user", "content": "".join(b.get("text", "") for b in texts)})
    return out


def parse_messages(body) -> ChatRequest:
    """A Messages request, checked; GatewayError (400) names what is wrong."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool) \
            or body["max_tokens"] < 1:
        raise GatewayError(400, "max_tokens: a positive integer is required", "max_tokens")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or any(
            not isinstance(t, dict) or not t.get("name") for t in tools)):
        raise GatewayError(400, "tools: must be an array of {name, input_schema}", "tools")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or
                                 thinking.get("type") not in THINKING):
        raise GatewayError(400, "thinking.type: must be one of " + ", ".join(THINKING),
                           "thinking.type")
    for name in ("output_config", "context_management", "metadata"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise GatewayError(400, f"{name}: must be an object", name)
    sampling = {"max_tokens": body["max_tokens"]}
    for name, hi in (("temperature", 1), ("top_p", 1)):
        value = checked_number(body, name, 0, hi)
        if value is not None:
            sampling[name] = value
    if isinstance(body.get("top_k"), int) and not isinstance(body.get("top_k"), bool):
        sampling["top_k"] = body["top_k"]
    # Client tools (no ``type``, or "custom") the prompt lists; a deferred one is not in it
    # until it is loaded; server tools (web search, code execution) are not served.
    functions = [{"type": "function", "function": {
        "name": t["name"], "description": t.get("description", ""),
        "parameters": t.get("input_schema") or {"type": "object"}}} for t in tools or []
        if t.get("type") in (None, "custom") and not t.get("defer_loading")]
    req = ChatRequest(model=str(body.get("model") or ""), messages=_messages(body),
                      tools=functions or None, tool_choice=body.get("tool_choice"),
                      stream=bool(body.get("stream")), include_usage=True,
                      sampling=sampling, stop=list(body.get("stop_sequences") or []))
    req.thinking = (thinking or {}).get("type", "disabled") != "disabled"
    req.show_thinking = (thinking or {}).get("display") != "omitted"
    return req


def parse_count(body) -> ChatRequest:
    """A ``count_tokens`` request: a Messages request without ``max_tokens``."""
    if isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}
    return parse_messages(body)


def _content(reply: Reply, req: ChatRequest | None = None) -> list[dict]:
    blocks = []
    if req is not None and req.thinking and reply.reasoning:
        blocks.append({"type": "thinking", "signature": reply.handle(),
                       "thinking": reply.reasoning if req.show_thinking else ""})
    if reply.content or not reply.tool_calls and not blocks:
        blocks.append({"type": "text", "text": reply.content})
    blocks += [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                "name": c["function"]["name"], "input": c["function"]["arguments"]}
               for c in reply.tool_calls]
    return blocks


def messages_response(reply: Reply, prompt_tokens: int, model: str,
                      req: ChatRequest | None = None) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": model, "content": _content(reply, req),
            "stop_reason": STOP_REASONS.get(reply.finish_reason, "end_turn"),
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(reply.token_ids)}}


def messages_stream(reply: Reply, prompt_tokens: int, model: str,
                    req: ChatRequest | None = None) -> Iterator[bytes]:
    """The answer as Messages stream events."""

    def event(kind: str, data: dict) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

    whole = messages_response(reply, prompt_tokens, model, req)
    yield event("message_start", {"message": {**whole, "content": [], "stop_reason": None,
                                              "usage": {"input_tokens": prompt_tokens,
                                                        "output_tokens": 0}}})
    for index, block in enumerate(whole["content"]):
        if block["type"] == "thinking":
            yield event("content_block_start", {"index": index, "content_block": {
                "type": "thinking", "thinking": "", "signature": ""}})
            text = block["thinking"]
            for i in range(0, len(text), 64):
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": text[i:i + 64]}})
            yield event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": block["signature"]}})
        elif block["type"] == "text":
            yield event("content_block_start", {"index": index, "content_block": {
                "type": "text", "text": ""}})
            text = block["text"]
            for i in range(0, len(text), 16):
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "text_delta", "text": text[i:i + 16]}})
        else:
            yield event("content_block_start", {"index": index, "content_block": {
                **block, "input": {}}})
            args = json.dumps(block["input"])
            for i in range(0, len(args), 16):
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": args[i:i + 16]}})
        yield event("content_block_stop", {"index": index})
    yield event("message_delta", {"delta": {"stop_reason": whole["stop_reason"],
                                            "stop_sequence": None},
                                  "usage": {"output_tokens": len(reply.token_ids)}})
    yield event("message_stop", {})
