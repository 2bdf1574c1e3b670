"""Tool-call parsers: find the calls in a turn's sampled text.

``hermes`` (the default): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as the
Qwen2.5/Qwen3 and Hermes chat templates ask for; several per turn. ``qwen3_coder``: Qwen3-Coder's
XML calls, ``<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
</tool_call>`` (a value that reads as a JSON object, array, number, boolean or null is that;
anything else is a string). ``llama3_json``: Llama 3.1's JSON calls, ``{"name": ...,
"parameters": {...}}`` (optionally after ``<|python_tag|>``), one or several separated by ``;``.
A call that cannot be read is reported, not dropped: the agent loop answers it with an error
observation and counts it. ``without_calls`` gives a turn's text without its calls (what an API
answers as the message's content), and :func:`split_reasoning` a leading ``<think>`` block
(Qwen3, DeepSeek-R1) apart from the rest.
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

    def without_calls(self, text: str) -> str:
        """``text`` without its tool calls."""
        return _TOOL_CALL_BLOCK.sub("", text).strip()


_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*", re.DOTALL)


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, the rest) of a turn that opens with a ``<think>`` block (or, as Qwen3's
    template starts it in the prompt, has only its close); ("", text) otherwise."""
    if "</think>" not in text:
        return "", text
    match = _THINK.match(text)
    if match is None:
        return "", text
    return match.group(1).strip(), text[match.end():]


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


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    _function = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)",
                            re.DOTALL)

    def parse(self, text: str) -> Parsed:
        out = Parsed()
        for block in HermesParser._block.finditer(text):
            body = block.group(1)
            functions = list(self._function.finditer(body))
            if not functions:
                out.errors.append("a tool call needs <function=NAME>")
                continue
            for fn in functions:
                args = {}
                for p in self._parameter.finditer(fn.group(2)):
                    args[p.group(1).strip()] = _value(p.group(2))
                out.calls.append(ToolCall(fn.group(1).strip(), args))
        return out


def _value(raw: str):
    text = raw.strip()
    if text[:1] in "{[" or text in ("true", "false", "null") or re.fullmatch(
            r"-?\d+(\.\d+)?([eE][-+]?\d+)?", text):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return raw


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def without_calls(self, text: str) -> str:
        head = text.split("<|python_tag|>", 1)[0] if "<|python_tag|>" in text else ""
        return head.strip() if self.parse(text).any else text

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
                                        "qwen3_coder": Qwen3CoderParser,
                                        "llama3_json": Llama3JsonParser}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}") from None
