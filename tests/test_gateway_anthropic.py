"""The gateway's Anthropic Messages endpoint with the real ``anthropic`` SDK as the client:
``tool_use`` and ``tool_result`` blocks round-tripped over three turns with a scripted
policy, whole and streamed (``text_delta`` and ``input_json_delta`` events), captured as
one token-exact segment; errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import pytest

from tests.farm import sampled_ids
from tests.policy_server import PolicyServer, text_planner
from tests.test_gateway_openai import CALL, _job, gateway  # noqa: F401 - fixture

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
    out = gateway.close_job(key).result()
    assert out["capture"]["calls"] == 3 and out["capture"]["merged"] == 2
    (seg,) = out["segments"]
    assert sampled_ids(seg) == [t for g in returned for t in g.token_ids]
