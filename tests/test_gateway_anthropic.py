"""The gateway's Anthropic Messages endpoint with the real ``anthropic`` SDK as the client:
``tool_use`` and ``tool_result`` blocks round-tripped over three turns with a scripted
policy, whole and streamed (``text_delta`` and ``input_json_delta`` events), captured as
one token-exact segment; errors in Anthropic's shape. What Claude Code sends (a request
recorded from it: mid-conversation system messages, system blocks, thinking, deferred and
server tools, ``?beta=true``, ``count_tokens``) served and placed as Anthropic places it,
and rendered for a template that refuses a later system message; a saturated backend's 529
with ``retry-after``, and the retry merged into the segment."""

from __future__ import annotations

import anthropic
import pytest

from tests.farm import sampled_ids
from tests.policy_server import PolicyServer, text_planner
from tests.test_gateway_openai import CALL, _closed, _job, gateway  # noqa: F401 - fixture

TOOLS = [{"name": "bash", "description": "run a command",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def test_tool_use_round_trips_through_the_anthropic_sdk(gateway, tiny_model):  # noqa: F811
    policy = PolicyServer(planner=text_planner(str(tiny_model), {
        "ls": [CALL, CALL, "There are two files."]}))
    returned: list = []
    key = gateway.open_job(_job(tiny_model, policy.url, returned, {"temperature": 1.0}))
    sdk = anthropic.Anthropic(base_url=gateway.url, api_key=key, max_retries=0)
    try:
        messages = [{"role": "user", "content": "[case:ls] What is here?"}]
        first = sdk.messages.create(model="tiny", max_tokens=64, system="You run commands.",
                                    messages=messages, tools=TOOLS)
        assert first.stop_reason == "tool_use"
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "bash" and use.input == {"command": "ls -1"}
        assert first.usage.output_tokens == len(returned[0].token_ids)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use.id,
                                                   "content": "a.py\nb.py"}]}]
        with sdk.messages.stream(model="tiny", max_tokens=64, system="You run commands.",
                                 messages=messages, tools=TOOLS) as stream:
            second = stream.get_final_message()
        assert second.stop_reason == "tool_use"
        (use2,) = [b for b in second.content if b.type == "tool_use"]
        assert use2.input == {"command": "ls -1"}
        messages += [{"role": "assistant", "content": [b.model_dump() for b in second.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use2.id,
                                                   "content": "a.py\nb.py"}]}]
        last = sdk.messages.create(model="tiny", max_tokens=64, system="You run commands.",
                                   messages=messages, tools=TOOLS)
        assert last.stop_reason == "end_turn"
        assert [b.text for b in last.content] == ["There are two files."]
        with pytest.raises(anthropic.BadRequestError):
            sdk.messages.create(model="tiny", max_tokens=0, messages=messages)
        with anthropic.Anthropic(base_url=gateway.url, api_key="prorl-nope",
                                 max_retries=0) as other, \
                pytest.raises(anthropic.AuthenticationError):
            other.messages.create(model="tiny", max_tokens=8, messages=messages)
    finally:
        sdk.close()
        policy.kill()
    _closed(gateway, key, returned, calls=3, merged=2)


def _raw(server, key: str, path: str, body: dict) -> tuple[int, dict, dict]:
    """POST ``body`` as Claude Code does (``?beta=true``, beta headers); (status, JSON,
    headers)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), method="POST",
                                 headers={"x-api-key": key, "content-type": "application/json",
                                          "anthropic-version": "2023-06-01",
                                          "anthropic-beta": "claude-code-20250219,"
                                                            "interleaved-thinking-2025-05-14"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


CLAUDE_CODE_TURN = {
    "model": "tiny", "max_tokens": 32000, "stream": False,
    "system": [{"type": "text", "text": "x-billing: 1;"},
               {"type": "text", "text": "You are an agent.", "cache_control": {
                   "type": "ephemeral"}},
               {"type": "text", "text": "\nBe brief.", "cache_control": {"type": "ephemeral"}}],
    "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "metadata": {"user_id": "u"},
    "tools": [*TOOLS, {"name": "Later", "description": "deferred", "defer_loading": True,
                       "input_schema": {"type": "object"}},
              {"type": "web_search_20250305", "name": "web_search"}]}


def test_what_claude_code_sends_is_served_and_rendered_as_anthropic_places_it(
        gateway, tiny_model):  # noqa: F811
    """Mid-conversation system messages (right after a user turn, else 400), system blocks
    joined as one prompt, thinking blocks with signatures that round trip, a deferred tool
    and a server tool not offered to the model, count_tokens, errors with request ids."""
    think = "<think>\nadd them\n</think>\n\n"
    policy = PolicyServer(planner=text_planner(str(tiny_model), {
        "cc": [think + CALL, "Four."]}))
    returned: list = []
    key = gateway.open_job(_job(tiny_model, policy.url, returned, {"temperature": 1.0}))
    try:
        messages = [{"role": "user", "content": [{"type": "text", "text": "[case:cc] 2+2?"}]},
                    {"role": "system", "content": "# Environment\ncwd: /workspace"}]
        body = {**CLAUDE_CODE_TURN, "messages": messages}
        status, counted, _ = _raw(gateway, key, "/v1/messages/count_tokens?beta=true",
                                  {k: v for k, v in body.items() if k != "max_tokens"})
        assert status == 200 and counted["input_tokens"] > 0
        status, first, _ = _raw(gateway, key, "/v1/messages?beta=true", body)
        assert status == 200, first
        kinds = [b["type"] for b in first["content"]]
        assert kinds == ["thinking", "tool_use"], first["content"]
        assert first["content"][0]["thinking"] == "add them"
        assert first["content"][0]["signature"].startswith("prorl:")
        assert first["usage"]["input_tokens"] == counted["input_tokens"]
        use = first["content"][1]
        messages += [{"role": "assistant", "content": first["content"]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use["id"],
                                                   "content": "a.py\nb.py"}]}]
        status, last, _ = _raw(gateway, key, "/v1/messages?beta=true",
                               {**body, "messages": messages,
                                "thinking": {"type": "adaptive", "display": "omitted"}})
        assert status == 200 and last["content"] == [{"type": "text", "text": "Four."}]
        # A system message after an assistant turn, or first: refused, the message named.
        for bad, at in (([{"role": "system", "content": "x"}, *messages], 0),
                        ([*messages[:3], {"role": "system", "content": "x"}], 3)):
            status, err, headers = _raw(gateway, key, "/v1/messages", {**body,
                                                                      "messages": bad})
            assert status == 400 and err["type"] == "error", err
            assert err["error"]["type"] == "invalid_request_error"
            assert err["error"]["message"].startswith(f"messages.{at}: a system message")
            assert err["request_id"].startswith("req_") and \
                headers["request-id"] == err["request_id"]
    finally:
        policy.kill()
    out = gateway.close_job(key).result()
    (seg,) = out["segments"]
    assert out["capture"]["merged"] == 1
    assert sampled_ids(seg) == [t for g in returned for t in g.token_ids]
    text = seg["messages"]
    assert text[0] == {"role": "system",
                       "content": "x-billing: 1;\nYou are an agent.\n\nBe brief."}
    assert text[2] == {"role": "system", "content": "# Environment\ncwd: /workspace"}
    prompt = policy_prompt_text(tiny_model, seg["prompt_ids"])
    assert '"name": "bash"' in prompt and "Later" not in prompt and "web_search" not in prompt


def policy_prompt_text(tiny_model, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True).decode(ids)


def test_a_template_that_refuses_a_later_system_message_gets_it_as_a_reminder(tiny_model,
                                                                              tmp_path):
    """Qwen templates raise on a system message that is not first: the capture renders one
    as a user turn holding it in <system-reminder> tags, and a leading run of system
    messages as one."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from prorl_farm.agent.parsers import get_parser
    from prorl_farm.agent.trajectory import load_chat_tokens
    from prorl_farm.gateway.capture import Capture

    strict = tmp_path / "strict"
    shutil.copytree(tiny_model, strict)
    (strict / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((strict / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- for message in messages %}{%- if message['role'] == 'system' and not loop.first"
        " %}{{ raise_exception('System message must be at the beginning.') }}{%- endif %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'"
        " }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- endif %}")
    (strict / "tokenizer_config.json").write_text(json.dumps(config))
    capture = Capture(load_chat_tokens(str(strict)), get_parser("hermes"))
    ids = capture.prompt([{"role": "system", "content": "A"}, {"role": "system",
                                                               "content": "B"},
                          {"role": "user", "content": "q"},
                          {"role": "system", "content": "env"}])
    tok = AutoTokenizer.from_pretrained(str(strict), local_files_only=True)
    assert tok.decode(ids) == (
        "<|im_start|>system\nA\n\nB<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>user\n<system-reminder>\nenv\n</system-reminder><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_saturated_backend_gets_529_with_retry_after_and_the_retry_merges(
        gateway, tiny_model):  # noqa: F811
    from prorl_farm.errors import BackendUnavailable

    policy = PolicyServer(planner=text_planner(str(tiny_model), {"ls": [CALL, "Done."]}))
    returned: list = []
    job = _job(tiny_model, policy.url, returned, {})
    sample, saturated = job.sampler, [True]

    def flaky(prompt, params):  # the second call finds every backend full, once
        if len(returned) == 1 and saturated:
            saturated.pop()
            raise BackendUnavailable("every backend is at capacity")
        return sample(prompt, params)

    job.sampler = flaky
    key = gateway.open_job(job)
    try:
        body = {"model": "tiny", "max_tokens": 64, "tools": TOOLS,
                "messages": [{"role": "user", "content": "[case:ls] here?"}]}
        status, first, _ = _raw(gateway, key, "/v1/messages", body)
        assert status == 200
        body["messages"] += [{"role": "assistant", "content": first["content"]},
                             {"role": "user", "content": [{"type": "tool_result",
                                                           "tool_use_id": "t", "content": "x"}]}]
        status, err, headers = _raw(gateway, key, "/v1/messages", body)
        assert status == 529 and err["error"]["type"] == "overloaded_error", err
        assert headers["retry-after"] == "2"
        status, last, _ = _raw(gateway, key, "/v1/messages", body)  # the client's retry
        assert status == 200 and last["content"][0]["text"] == "Done."
    finally:
        policy.kill()
    out = gateway.close_job(key).result()
    assert out["capture"] == {**out["capture"], "calls": 3, "merged": 1, "segments": 1}
