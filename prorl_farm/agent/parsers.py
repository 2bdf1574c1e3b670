"""Tool-call parsers: find the calls in a turn's sampled text.

``hermes`` (the default): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as the
Qwen2.5/Qwen3 and Hermes chat templates ask for; several per turn. ``llama3_json``: Llama 3.1's
JSON calls, ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), one or
several separated by ``;``. A call that cannot be read is reported, not dropped: the agent loop
answers it with an error observation and counts it.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class Parsed:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per malformed call

    @property
    def any(self) -> bool:
        return bool(self.calls or self.errors)


def _call_from(obj, args_key: str) -> ToolCall | str:
    """A ToolCall from a decoded JSON object, or why it is not one."""
    if not isinstance(obj, dict):
        return "a tool call must be a JSON object"
    name = obj.get("name")
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models send arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return f"{args_key} of {name!r} is not valid JSON"
    if not isinstance(name, str) or not name:
        return "a tool call needs a string 'name'"
    if not isinstance(args, dict):
        return f"{args_key} of {name!r} must be a JSON object"
    return ToolCall(name, args)


class ToolParser(ABC):
    name = ""

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """The calls in ``text`` and the malformed ones."""


class HermesParser(ToolParser):
    name = "hermes"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        out = Parsed()
        for match in self._block.finditer(text):
            body = match.group(1).strip()
            try:
                obj = json.loads(body)
            except ValueError as e:
                out.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos})")
                continue
            call = _call_from(obj, "arguments")
            (out.calls if isinstance(call, ToolCall) else out.errors).append(call)
        return out


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str) -> Parsed:
        out = Parsed()
        body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
        body = body.replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
        if not body.startswith("{"):
            return out  # an answer, not a call
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError as e:
                out.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos})")
                break
            call = _call_from(obj, "parameters")
            (out.calls if isinstance(call, ToolCall) else out.errors).append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return out


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser,
                                        "llama3_json": Llama3JsonParser}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}") from None
