"""OpenAI Responses as the gateway speaks it (what Codex calls): ``input`` as a string or
items (messages with text parts, ``developer`` ones included; ``function_call`` /
``function_call_output``; ``custom_tool_call`` / ``custom_tool_call_output``; ``reasoning``
items, which are the model's own and skipped: the capture keeps its sampled ids),
``instructions``, ``function`` and ``custom`` tools (a custom tool, such as Codex's
``apply_patch`` with its grammar, is offered to the model as a function of one string
``input``; ``namespace`` tools are offered as their functions), ``previous_response_id`` or
``store: false`` with the whole history resent, ``max_output_tokens``, ``temperature``,
``top_p``; the answer whole or as its server-sent events (``response.created`` ...
``response.output_item.done`` for each item ... ``response.completed`` with ``usage``).
A reply that opens with a ``<think>`` block gives a ``reasoning`` item whose
``encrypted_content`` is the farm's handle to the exact ids sampled. The request becomes a
chat conversation, so capture and merging are the Chat Completions path's."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from prorl_farm.gateway.capture import Reply, content_text
from prorl_farm.gateway.openai_api import GatewayError, checked_number

REQUEST_SAMPLING = {"temperature": ("temperature", 0, 2), "top_p": ("top_p", 0, 1),
                    "max_output_tokens": ("max_tokens", 1, 1 << 20)}
ROLES = ("system", "developer", "user", "assistant")


# Server-side tools (web search, file search, ...) the gateway does not serve: dropped from
# what the model is offered, as a server without them would.
SERVER_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                "code_interpreter", "image_generation", "local_shell", "mcp")


@dataclass
class ResponsesRequest:
    model: str
    messages: list[dict]  # the conversation as chat messages (earlier responses' included)
    tools: list[dict] | None  # as Chat Completions tools
    raw_tools: list
    custom: set[str]  # the names of custom tools (their calls are custom_tool_call items)
    stream: bool
    previous_response_id: str | None
    instructions: str | None
    sampling: dict = field(default_factory=dict)
    body: dict = field(default_factory=dict)


def _items(value) -> list:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise GatewayError(400, "'input' must be a string or a non-empty array of items",
                           "input")
    return value


def input_messages(items: list) -> list[dict]:
    """Responses input items as chat messages: function calls join the assistant message
    before them (or make one), their outputs become tool messages; reasoning items are
    skipped (they were the model's, and the capture keeps its sampled ids)."""
    out: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise GatewayError(400, f"input[{i}] must be an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise GatewayError(400, f"input[{i}]: 'role' must be one of {', '.join(ROLES)}",
                                   f"input[{i}].role")
            content = item.get("content")
            if not isinstance(content, (str, list)):
                raise GatewayError(400, f"input[{i}]: 'content' must be a string or parts",
                                   f"input[{i}].content")
            out.append({"role": "system" if role == "developer" else role,
                        "content": content_text(content)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"),
                                                                       str):
                raise GatewayError(400, f"input[{i}]: a function_call needs 'name' and "
                                   "'call_id'", f"input[{i}]")
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}})
        elif kind == "custom_tool_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("input"), str):
                raise GatewayError(400, f"input[{i}]: a custom_tool_call needs 'name' and "
                                   "'input'", f"input[{i}]")
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append({
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item["name"], "arguments": {"input": item["input"]}}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(item.get("call_id"), str):
                raise GatewayError(400, f"input[{i}]: a {kind} needs 'call_id'",
                                   f"input[{i}].call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else
                        content_text(output) if isinstance(output, list) else
                        json.dumps(output)})
        elif kind != "reasoning":
            raise GatewayError(400, f"input[{i}]: items of type {kind!r} are not served "
                               "(message, function_call, function_call_output, "
                               "custom_tool_call, custom_tool_call_output, reasoning)",
                               f"input[{i}].type")
    return out


def _functions(raw_tools) -> tuple[list[dict], set[str]]:
    """The tools the model is offered, as Chat Completions functions, and the names of the
    custom ones."""
    if not isinstance(raw_tools, list):
        raise GatewayError(400, "'tools' must be an array", "tools")
    functions, custom = [], set()
    for i, t in enumerate(raw_tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind in SERVER_TOOLS:
            continue
        if kind == "namespace" and isinstance(t.get("tools"), list):
            inner, names = _functions(t["tools"])
            functions += inner
            custom |= names
            continue
        if kind not in ("function", "custom") or not isinstance(t.get("name"), str) \
                or not t["name"]:
            raise GatewayError(400, f"tools[{i}]: a tool is a function, custom or namespace "
                               f"tool with a name (type {kind!r} is not served)",
                               f"tools[{i}]")
        if kind == "custom":
            custom.add(t["name"])
            about = t.get("description") or ""
            fmt = t.get("format") or {}
            if fmt.get("type") == "grammar" and fmt.get("definition"):
                about += (f"\n\nThe input follows this {fmt.get('syntax', '')} grammar:\n"
                          f"{fmt['definition']}")
            params = {"type": "object", "properties": {"input": {
                "type": "string", "description": "the tool's input, as free text"}},
                "required": ["input"]}
        else:
            about = t.get("description") or ""
            params = t.get("parameters") or {"type": "object", "properties": {}}
        functions.append({"type": "function", "function": {
            "name": t["name"], "description": about, "parameters": params}})
    return functions, custom


def parse_responses(body, history: dict[str, list[dict]]) -> ResponsesRequest:
    """A Responses request, checked; ``history``: the job's earlier responses' conversations
    by id (for ``previous_response_id``)."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    raw_tools = body.get("tools") or []
    functions, custom = _functions(raw_tools)
    tools = functions or None
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError(400, "'instructions' must be a string", "instructions")
    previous = body.get("previous_response_id")
    earlier: list[dict] = []
    if previous is not None:
        if previous not in history:
            raise GatewayError(400, f"previous response {previous!r} is not one of this "
                               "job's", "previous_response_id")
        earlier = [m for m in history[previous] if m["role"] != "system"]
    messages = earlier + input_messages(_items(body.get("input")))
    if instructions:  # a response's instructions are its own: never carried over
        messages = [{"role": "system", "content": instructions}] + messages
    sampling = {}
    for name, (farm_name, lo, hi) in REQUEST_SAMPLING.items():
        value = checked_number(body, name, lo, hi)
        if value is not None:
            sampling[farm_name] = value
    return ResponsesRequest(model=str(body.get("model") or ""), messages=messages,
                            tools=tools, raw_tools=raw_tools, custom=custom,
                            stream=bool(body.get("stream")),
                            previous_response_id=previous, instructions=instructions,
                            sampling=sampling, body=body)


def _output(reply: Reply, custom: set[str] | frozenset = frozenset()) -> list[dict]:
    items: list[dict] = []
    if reply.reasoning:
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                      "encrypted_content": reply.handle()})
    if reply.content or not reply.tool_calls:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status":
                      "completed", "role": "assistant", "content": [
                          {"type": "output_text", "text": reply.content, "annotations": []}]})
    for call in reply.tool_calls:
        name, args = call["function"]["name"], call["function"]["arguments"]
        if name in custom:
            text = args.get("input") if isinstance(args.get("input"), str) else \
                next((v for v in args.values() if isinstance(v, str)), json.dumps(args))
            items.append({"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex}",
                          "call_id": f"call_{uuid.uuid4().hex[:24]}", "status": "completed",
                          "name": name, "input": text})
            continue
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                      "call_id": f"call_{uuid.uuid4().hex[:24]}", "status": "completed",
                      "name": call["function"]["name"],
                      "arguments": json.dumps(call["function"]["arguments"])})
    return items


def response_object(req: ResponsesRequest, reply: Reply, prompt_tokens: int, model: str,
                    response_id: str) -> dict:
    incomplete = reply.finish_reason == "length"
    return {"id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if incomplete else "completed", "model": model,
            "output": _output(reply, req.custom), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "metadata": req.body.get("metadata") or {},
            "parallel_tool_calls": bool(req.body.get("parallel_tool_calls", True)),
            "previous_response_id": req.previous_response_id,
            "temperature": req.body.get("temperature"), "top_p": req.body.get("top_p"),
            "max_output_tokens": req.body.get("max_output_tokens"),
            "tool_choice": req.body.get("tool_choice", "auto"), "tools": req.raw_tools,
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(reply.token_ids),
                      "total_tokens": prompt_tokens + len(reply.token_ids),
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def responses_stream(response: dict) -> Iterator[bytes]:
    """The response as Responses server-sent events: created, in progress, each output item
    (a message's text in deltas, a function call's arguments in deltas), completed."""
    seq = 0

    def event(kind: str, **data) -> bytes:
        nonlocal seq
        doc = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(doc)}\n\n".encode()

    pending = {**response, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=pending)
    yield event("response.in_progress", response=pending)
    for index, item in enumerate(response["output"]):
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": []}
            yield event("response.content_part.added", **ids, content_index=0, part=part)
            for i in range(0, len(text), 16):
                yield event("response.output_text.delta", **ids, content_index=0,
                            delta=text[i:i + 16], logprobs=[])
            yield event("response.output_text.done", **ids, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", **ids, content_index=0,
                        part={**part, "text": text})
        elif item["type"] == "reasoning":
            yield event("response.output_item.added", output_index=index, item=item)
        else:  # a call: its input (custom) or arguments (function) in deltas
            field, kind = (("input", "custom_tool_call_input")
                           if item["type"] == "custom_tool_call" else
                           ("arguments", "function_call_arguments"))
            text = item[field]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", field: ""})
            for i in range(0, len(text), 16):
                yield event(f"response.{kind}.delta", **ids, delta=text[i:i + 16])
            yield event(f"response.{kind}.done", **ids, **{field: text})
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed", response=response)


def reply_messages(response: dict) -> list[dict]:
    """The response's output as the chat message it continues a conversation with."""
    message: dict = {"role": "assistant", "content": ""}
    for item in response["output"]:
        if item["type"] == "message":
            message["content"] = item["content"][0]["text"]
        elif item["type"] == "custom_tool_call":
            message.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": {"input": item["input"]}}})
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})
    return [message]
