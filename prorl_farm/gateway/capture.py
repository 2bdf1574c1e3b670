"""Token-exact capture of a harness's model calls (the per-job model gateway's core).

A harness (an agent of its own, talking to an OpenAI- or Anthropic-style endpoint) sends
each call as a whole conversation. The gateway turns each into prompt ids and keeps what
the policy sampled exactly:

- A call whose conversation is the previous one, plus the assistant reply the gateway
  produced for it (as the client sends it back), plus new messages, *extends* the current
  segment: its prompt is the segment's context (the reply's sampled ids, never a
  re-rendering of its text) followed by the template's glue and the new messages, as the
  built-in loop builds its context (agent/trajectory.py). Sampled tokens get mask 1 and
  their logprobs; everything else mask 0.
- Any other call (the harness truncated, summarised or rewrote its history, changed its
  tools, or edited a reply) starts a new segment rendered afresh from its messages; the
  capture stats say where it diverged from the context so far (the first differing token).

A system message after the first (Anthropic's mid-conversation ``system``, an OpenAI
``developer`` message later on) is rendered as a system message where the model's chat
template takes one there; where it does not (Qwen's templates refuse a system message that
is not the first), as a user message holding its text in ``<system-reminder>`` tags, the
form coding harnesses give such instructions in a user turn.

A call the backend could not sample (``rollback``) leaves the capture as it was, so the
client's retry of the same conversation extends the segment as the call would have.

``result()`` gives the segments in the trajectory format of docs/trajectory.md (a trainer
takes one sample per segment) and the stats: calls, merged, segments, splits.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from prorl_farm.agent.parsers import ToolParser, split_reasoning
from prorl_farm.agent.trajectory import ChatTokens, Trajectory
from prorl_farm.errors import FarmError


class ContextFull(FarmError, ValueError):
    """The conversation leaves no room to generate within the context length."""


def content_text(content) -> str:
    """A message's content as text: a string, or the text of OpenAI/Anthropic parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") in ("text", "input_text",
                                                               "output_text"):
            parts.append(str(part.get("text", "")))
    return "".join(parts)


def _arguments(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return {"_raw": raw}
    return value if isinstance(value, dict) else {"_raw": value}


def normalise(message: dict) -> dict:
    """A chat message in the form the chat template takes (OpenAI's tool calls with their
    arguments as objects; content as text); ids and other API details are dropped, so a
    reply the client sends back compares equal to the one the gateway produced."""
    role = message.get("role")
    out: dict = {"role": role, "content": content_text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls:
        out["tool_calls"] = [{"type": "function", "function": {
            "name": c.get("function", {}).get("name", ""),
            "arguments": _arguments(c.get("function", {}).get("arguments"))}} for c in calls]
    return out


@dataclass
class Reply:
    """What one call's sampled ids say: the text without tool-call markup, the calls."""

    content: str
    tool_calls: list[dict]
    finish_reason: str
    token_ids: list[int]
    logprobs: list[float]
    reasoning: str = ""  # a leading <think> block's text (not part of ``content``)

    def handle(self) -> str:
        """The farm's handle to the exact ids sampled: what a thinking block's signature
        (Anthropic) or a reasoning item's ``encrypted_content`` (Responses) carries back."""
        return "prorl:" + hashlib.sha256(json.dumps(self.token_ids).encode()).hexdigest()[:32]


@dataclass
class Capture:
    """One job's gateway capture: segments of token-exact trajectories, and stats."""

    chat: ChatTokens
    parser: ToolParser
    context_length: int | None = None
    segments: list[Trajectory] = field(default_factory=list)
    calls: int = 0
    merged: int = 0
    splits: list[dict] = field(default_factory=list)
    _seen: list[dict] = field(default_factory=list)  # the conversation so far, normalised
    _tools: list | None = None
    _undo: tuple | None = None
    # The last call's messages as sent, and as placed.
    _last_placed: tuple[list, list] = field(default_factory=lambda: ([], []))

    def placed(self, messages: list[dict]) -> list[dict]:
        """The conversation normalised, its later system messages placed as the template
        allows. A harness resends its whole history each call: where the messages begin
        with the very ones of the last call (compared as sent, which costs little), only
        the rest is normalised, so a call's cost does not grow with the conversation."""
        raw, done = self._last_placed
        n = len(raw)
        if n and len(messages) > n and messages[:n] == raw and \
                any(m["role"] != "system" for m in done):
            out = done + self._place([normalise(m) for m in messages[n:]], first=False)
        else:
            out = self._place([normalise(m) for m in messages], first=True)
        self._last_placed = (list(messages), out)
        return list(out)

    def _place(self, conversation: list[dict], first: bool) -> list[dict]:
        """Later system messages placed as the template allows (``first``: the conversation
        from its beginning)."""
        if self.chat.accepts_mid_system():  # probed once per tokenizer
            return conversation
        if first:
            lead = next((i for i, m in enumerate(conversation) if m["role"] != "system"),
                        len(conversation))
            if lead:  # a leading run of system messages (Codex's developer messages): one
                conversation = [{"role": "system", "content": "\n\n".join(
                    m["content"] for m in conversation[:lead])}] + conversation[lead:]
        return [m if m["role"] != "system" or (first and i == 0) else
                {"role": "user", "content": f"<system-reminder>\n{m['content']}\n"
                                            "</system-reminder>"}
                for i, m in enumerate(conversation)]

    def count(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        """The length of a conversation's prompt, rendered afresh (nothing kept)."""
        return len(self.chat.prompt_ids(self.placed(messages), tools or None))

    def rollback(self) -> None:
        """Forget the last :meth:`prompt` (its call was not sampled)."""
        if self._undo is None:
            return
        segments, current, sizes, self._seen, self._tools, splits, self.merged = self._undo
        self.segments[:] = segments
        if current is not None:
            n_resp, n_msgs = sizes
            del current.response_ids[n_resp:], current.response_mask[n_resp:]
            del current.response_logprobs[n_resp:], current.messages[n_msgs:]
        del self.splits[splits:]
        self._undo = None

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of a call: the current segment extended, or a new segment."""
        conversation = self.placed(messages)
        tools = tools or None
        current = self.segments[-1] if self.segments else None
        self.calls += 1
        self._undo = (list(self.segments), current,
                      (len(current.response_ids), len(current.messages)) if current else None,
                      self._seen, self._tools, len(self.splits), self.merged)
        if (current is not None and tools == self._tools
                and len(conversation) > len(self._seen)
                and conversation[:len(self._seen)] == self._seen
                and current.turns):
            new = conversation[len(self._seen):]
            if not current.add_messages(new, limit=self.context_length):
                raise ContextFull("the conversation leaves no room to generate within the "
                                  f"context length ({self.context_length} tokens)")
            self.merged += 1
            self._seen = conversation
            return current.context()
        fresh = Trajectory.start(self.chat, conversation, tools)
        if self.context_length and len(fresh.prompt_ids) >= self.context_length:
            raise ContextFull(f"the prompt is {len(fresh.prompt_ids)} tokens; the context "
                              f"length is {self.context_length}")
        if current is not None:
            before = current.context()
            diverged = next((i for i, (a, b) in enumerate(zip(before, fresh.prompt_ids))
                             if a != b), min(len(before), len(fresh.prompt_ids)))
            self.splits.append({"call": self.calls, "segment": len(self.segments),
                                "diverged_at": diverged})
        if current is not None and not current.turns:
            self.segments.pop()  # a segment that never sampled holds nothing to train on
        self.segments.append(fresh)
        self._seen, self._tools = conversation, tools
        return fresh.context()

    def record(self, sent: list[int], token_ids: list[int], logprobs: list[float],
               finish_reason: str, backend: str, policy_version: int,
               logprobs_mode: str, versions: list[tuple[int, int]] | None = None) -> Reply:
        """Keep what the backend sampled for ``sent`` (the ids :meth:`prompt` gave) and
        return the reply as the API answers it."""
        self._undo = None
        current = self.segments[-1]
        current.add_generation(sent, token_ids, logprobs, finish_reason, backend,
                               policy_version, logprobs_mode, versions)
        reasoning, text = split_reasoning(self.chat.decode(token_ids))
        parsed = self.parser.parse(text)
        calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in parsed.calls]
        content = self.parser.without_calls(text) if calls else text
        reply = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        self._seen = self._seen + [reply]
        return Reply(content, calls, finish_reason, list(token_ids), list(logprobs),
                     reasoning)

    def result(self) -> dict:
        """The segments (docs/trajectory.md's fields each) and the capture stats."""
        segments = [s.to_dict() for s in self.segments if s.turns]
        return {"segments": segments,
                "capture": {"calls": self.calls, "merged": self.merged,
                            "segments": len(segments), "splits": self.splits}}
