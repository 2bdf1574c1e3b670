"""The gateway's OpenAI Responses endpoint with the real ``openai`` SDK (what Codex-style
CLIs call): function calls round-tripped over three turns with a scripted policy, the
conversation sent whole (stateless, as ``store: false`` clients do), streamed through the
SDK's own event accumulator, and continued by ``previous_response_id``; every call merged
into one segment holding exactly the ids the backend returned; bad items refused with the
parameter named."""

from __future__ import annotations

import openai
import pytest

from tests.farm import sampled_ids
from tests.test_gateway_openai import CALL, gateway, scripted_job  # noqa: F401 - a fixture

TOOLS = [{"type": "function", "name": "bash", "description": "run a command",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}]


def test_function_calls_round_trip_through_the_responses_api(gateway, tiny_model):  # noqa: F811
    policy, returned, key, sdk = scripted_job(gateway, tiny_model, {
        "ls": [CALL, CALL, "There are two files."]})
    try:
        items: list = [{"role": "user", "content": "[case:ls] What is here?"}]
        first = sdk.responses.create(model="tiny", instructions="You run commands.",
                                     input=items, tools=TOOLS, store=False)
        assert first.status == "completed"
        (call,) = [o for o in first.output if o.type == "function_call"]
        assert call.name == "bash" and call.arguments == '{"command": "ls -1"}'
        assert first.usage.output_tokens == len(returned[0].token_ids)
        # Stateless: the whole conversation again, the call and its output as items.
        items += [o.model_dump(exclude_none=True) for o in first.output]
        items.append({"type": "function_call_output", "call_id": call.call_id,
                      "output": "a.py\nb.py"})
        with sdk.responses.stream(model="tiny", instructions="You run commands.",
                                  input=items, tools=TOOLS) as stream:
            kinds = [event.type for event in stream]
            second = stream.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.function_call_arguments.delta" in kinds
        (call2,) = [o for o in second.output if o.type == "function_call"]
        assert call2.arguments == '{"command": "ls -1"}'
        # Stateful: only the new item, after the previous response.
        last = sdk.responses.create(model="tiny", instructions="You run commands.",
                                    previous_response_id=second.id, tools=TOOLS,
                                    input=[{"type": "function_call_output",
                                            "call_id": call2.call_id, "output": "a.py\nb.py"}])
        assert last.output_text == "There are two files."
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.responses.create(model="tiny", input=[{"type": "web_search_call"}])
        assert bad.value.body["param"] == "input[0].type"
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.responses.create(model="tiny", input="x", previous_response_id="resp_other")
        assert bad.value.body["param"] == "previous_response_id"
    finally:
        sdk.close()
        policy.kill()
    out = gateway.close_job(key).result()
    assert out["capture"]["calls"] == 3 and out["capture"]["merged"] == 2, out["capture"]
    (seg,) = out["segments"]
    assert sampled_ids(seg) == [t for g in returned for t in g.token_ids]


def test_what_codex_sends_round_trips_custom_tools_and_reasoning(gateway, tiny_model):  # noqa: F811
    """Codex's request shape: developer messages, a custom tool (apply_patch, with its
    grammar), a namespace of functions, a web search tool (not served: not offered),
    ``store: false`` with the whole history resent, reasoning items echoed back with their
    ``encrypted_content``; the stream ends each item with output_item.done and the response
    with usage; all of it one segment of the ids the policy sampled."""
    import json
    import urllib.request

    patch = "*** Begin Patch\n*** Update File: a.py\n@@\n-x\n+y\n*** End Patch"
    think = "<think>\nfix a.py\n</think>\n\n"
    policy, returned, key, sdk = scripted_job(gateway, tiny_model, {
        "cx": [think + '<tool_call>\n{"name": "apply_patch", "arguments": {"input": '
               + json.dumps(patch) + "}}\n</tool_call>", "Patched."]})
    sdk.close()
    gateway.jobs[key].max_tokens = 512  # the patch is longer than the fixture's 64
    tools = [{"type": "custom", "name": "apply_patch", "description": "edit files",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
             {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [
                 {"type": "function", "name": "spawn_agent", "parameters": {
                     "type": "object", "properties": {}}}]},
             {"type": "web_search", "external_web_access": True}]
    items: list = [{"type": "message", "role": "developer", "content": [
        {"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "[case:cx] fix a.py"}]}]

    def call(body) -> list[dict]:
        req = urllib.request.Request(gateway.url + "/v1/responses", json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}",
                                              "content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return [json.loads(line[6:]) for line in r.read().decode().splitlines()
                    if line.startswith("data: ")]

    try:
        body = {"model": "tiny", "stream": True, "store": False, "tools": tools,
                "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"},
                "parallel_tool_calls": True, "tool_choice": "auto", "input": items}
        events = call(body)
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert [i["type"] for i in done] == ["reasoning", "custom_tool_call"], done
        assert done[0]["encrypted_content"].startswith("prorl:")
        assert done[1]["name"] == "apply_patch" and done[1]["input"] == patch
        assert "response.custom_tool_call_input.done" in kinds
        assert events[-1]["response"]["usage"]["output_tokens"] == len(returned[0].token_ids)
        items += done + [{"type": "custom_tool_call_output", "call_id": done[1]["call_id"],
                          "output": "Done!"}]
        last = call({**body, "input": items})
        (message,) = [e["item"] for e in last if e["type"] == "response.output_item.done"]
        assert message["content"][0]["text"] == "Patched."
    finally:
        policy.kill()
    out = gateway.close_job(key).result()
    assert out["capture"] == {**out["capture"], "calls": 2, "merged": 1, "segments": 1}
    (seg,) = out["segments"]
    assert sampled_ids(seg) == [t for g in returned for t in g.token_ids]
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True).decode(
        seg["prompt_ids"])
    assert '"name": "apply_patch"' in prompt and "start: x" in prompt
    assert '"name": "spawn_agent"' in prompt and "web_search" not in prompt
