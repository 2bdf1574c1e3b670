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
