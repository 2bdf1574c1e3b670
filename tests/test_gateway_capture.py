"""The gateway's capture: a harness's calls become token-exact segments. A call that
extends the conversation with the reply the gateway produced reuses its sampled ids (never
a re-rendering); a rewritten history starts a new segment, and the stats say where it
diverged. Run on the tiny model's real tokenizer and chat template (tools included)."""

from __future__ import annotations

import json

import pytest

from prorl_farm.agent.parsers import get_parser
from prorl_farm.agent.trajectory import load_chat_tokens
from prorl_farm.gateway.capture import Capture, ContextFull
from tests.farm import sampled_ids

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


@pytest.fixture
def chat(tiny_model):
    return load_chat_tokens(str(tiny_model))


def _sample(chat, text: str) -> tuple[list[int], list[float]]:
    """Ids as if the policy sampled ``text`` (with the end-of-turn token), and logprobs."""
    ids = chat.encode_text(text) + [chat.tok.convert_tokens_to_ids("<|im_end|>")]
    return ids, [-0.01 * (i + 1) for i in range(len(ids))]


def _call(capture, chat, messages, text, tools=TOOLS):
    sent = capture.prompt(messages, tools)
    ids, lps = _sample(chat, text)
    reply = capture.record(sent, ids, lps, "stop", "b1", 3, "processed_logprobs")
    return sent, ids, reply


def _echo(reply, call_id="call_1") -> dict:
    """The reply as the OpenAI SDK sends it back: ids, arguments as a JSON string."""
    msg = {"role": "assistant", "content": reply.content or None}
    if reply.tool_calls:
        msg["tool_calls"] = [{"id": call_id, "type": "function", "function": {
            "name": c["function"]["name"],
            "arguments": json.dumps(c["function"]["arguments"])}} for c in reply.tool_calls]
    return msg


def test_calls_that_extend_the_conversation_merge_into_one_exact_segment(chat):
    capture = Capture(chat, get_parser("hermes"))
    messages = [{"role": "system", "content": "You are a shell agent."},
                {"role": "user", "content": [{"type": "text", "text": "List the files."}]}]
    call = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    p1, s1, r1 = _call(capture, chat, messages, call)
    assert p1 == chat.prompt_ids([{"role": "system", "content": "You are a shell agent."},
                                  {"role": "user", "content": "List the files."}], TOOLS)
    assert r1.finish_reason == "tool_calls" and r1.content == ""
    assert r1.tool_calls == [{"type": "function", "function": {
        "name": "bash", "arguments": {"command": "ls"}}}]

    messages += [_echo(r1), {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"}]
    p2, s2, r2 = _call(capture, chat, messages, "Two files: a.py and b.py.")
    assert p2[:len(p1) + len(s1)] == p1 + s1  # the sampled ids themselves, not re-rendered
    assert r2.finish_reason == "stop" and r2.content == "Two files: a.py and b.py."

    messages += [_echo(r2), {"role": "user", "content": "Thanks."}]
    p3, s3, _ = _call(capture, chat, messages, "You're welcome.")
    assert p3[:len(p2) + len(s2)] == p2 + s2
    out = capture.result()
    assert out["capture"] == {"calls": 3, "merged": 2, "segments": 1, "splits": []}
    (seg,) = out["segments"]
    assert seg["prompt_ids"] == p1
    full = seg["prompt_ids"] + seg["response_ids"]
    assert full == p3 + s3
    assert sampled_ids(seg) == s1 + s2 + s3
    lps = [lp for lp, m in zip(seg["response_logprobs"], seg["response_mask"]) if m]
    assert lps == _sample(chat, call)[1] + _sample(chat, "Two files: a.py and b.py.")[1] + \
        _sample(chat, "You're welcome.")[1]
    assert all(lp == 0.0 for lp, m in zip(seg["response_logprobs"], seg["response_mask"])
               if not m)
    assert [t["offset"] for t in seg["turns"]] == [0, len(p2) - len(p1), len(p3) - len(p1)]


def test_a_rewritten_history_starts_a_new_segment_and_says_where(chat):
    capture = Capture(chat, get_parser("hermes"))
    messages = [{"role": "user", "content": "Task: count to three."}]
    p1, s1, r1 = _call(capture, chat, messages, "one two", tools=None)
    # The harness summarises: its own rewrite of the reply, not the reply it got.
    rewritten = messages + [{"role": "assistant", "content": "(counted to two)"},
                            {"role": "user", "content": "Go on."}]
    p2, _, _ = _call(capture, chat, rewritten, "three", tools=None)
    out = capture.result()
    assert out["capture"]["segments"] == 2 and out["capture"]["merged"] == 0
    (split,) = out["capture"]["splits"]
    assert split["call"] == 2 and split["segment"] == 1
    at = split["diverged_at"]
    assert (p1 + s1)[:at] == p2[:at] and (p1 + s1)[at] != p2[at]
    assert out["segments"][1]["prompt_ids"] == p2
    # Other tools: a new segment too (the system turn renders them).
    _call(capture, chat, rewritten + [{"role": "assistant", "content": "three"},
                                      {"role": "user", "content": "Now with tools."}],
          "ok", tools=TOOLS)
    assert capture.result()["capture"]["segments"] == 3


def test_a_conversation_past_the_context_length_is_refused(chat):
    capture = Capture(chat, get_parser("hermes"), context_length=40)
    with pytest.raises(ContextFull, match="context length"):
        capture.prompt([{"role": "user", "content": "word " * 60}])


def test_reasoning_and_qwen3_coder_calls_come_apart_and_the_sampled_ids_stay(chat):
    """A Qwen3-style turn (a <think> block, then Qwen3-Coder's XML call): the API answer
    carries the reasoning apart and the content without markup; sent back without the
    reasoning, as clients do, the call still extends the segment with the very ids that
    were sampled, the reasoning in them."""
    capture = Capture(chat, get_parser("qwen3_coder"))
    messages = [{"role": "user", "content": "List the files."}]
    turn = ("<think>\nI should list them.\n</think>\n\nLooking.\n<tool_call>\n<function=bash>\n"
            "<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>")
    p1, s1, r1 = _call(capture, chat, messages, turn)
    assert r1.reasoning == "I should list them." and r1.content == "Looking."
    assert r1.tool_calls == [{"type": "function", "function": {
        "name": "bash", "arguments": {"command": "ls"}}}]
    messages += [_echo(r1), {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
    p2, _, _ = _call(capture, chat, messages, "One file.")
    assert p2[:len(p1) + len(s1)] == p1 + s1
    assert capture.result()["capture"]["merged"] == 1
