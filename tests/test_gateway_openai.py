"""The gateway's OpenAI Chat Completions endpoint with the real ``openai`` SDK as the
client, streaming and not: tool calls round-tripped over several turns with a scripted
policy, and a free-running conversation with the tiny model whose captured segment holds
exactly the ids the backend returned, with teacher-forced logprobs matching; a job's key
refused for another and once the job ended; bad requests answered in OpenAI's shape."""

from __future__ import annotations

import openai
import pytest

from prorl_farm.agent.parsers import get_parser
from prorl_farm.agent.trajectory import load_chat_tokens
from prorl_farm.gateway.capture import Capture
from prorl_farm.gateway.server import GatewayServer, JobGateway, Sampled
from prorl_farm.llm.backends.abstract import _IDLE
from prorl_farm.llm.backends.vllm import VLLMClient
from tests.farm import sampled_ids
from tests.policy_server import PolicyServer, text_planner
from tests.test_tokens import teacher_forced_logprobs

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "run a command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]
CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -1"}}\n</tool_call>'


@pytest.fixture
def gateway():
    server = GatewayServer()
    yield server
    server.stop()
    for client in CLIENTS:
        client.close()
    CLIENTS.clear()
    _IDLE.close_all()  # the kept-alive connections to this test's backends


CLIENTS: list[VLLMClient] = []


def _closed(gateway, key: str, returned: list, calls: int, merged: int) -> None:
    """The job's capture, closed: ``calls`` model calls, ``merged`` of them merged into its
    one segment, whose sampled ids are exactly those the backend returned."""
    out = gateway.close_job(key).result()
    assert out["capture"]["calls"] == calls and out["capture"]["merged"] == merged
    (seg,) = out["segments"]
    assert sampled_ids(seg) == [t for g in returned for t in g.token_ids]


def _job(tiny_model, backend_url: str, returned: list, sampling: dict) -> JobGateway:
    client = VLLMClient(backend_url, "tiny")
    CLIENTS.append(client)

    def sampler(prompt, params):
        gen = client.generate(prompt, params)
        returned.append(gen)
        return Sampled(gen, "b0", 2, "raw_logprobs")

    return JobGateway("j1", Capture(load_chat_tokens(str(tiny_model)), get_parser("hermes")),
                      sampler, sampling, "tiny", max_tokens=64)


def scripted_job(gateway, tiny_model, plans: dict):
    """A job on ``gateway`` played by a scripted policy: (policy, returned generations,
    key, SDK client on that key)."""
    policy = PolicyServer(planner=text_planner(str(tiny_model), plans))
    returned: list = []
    key = gateway.open_job(_job(tiny_model, policy.url, returned, {"temperature": 1.0}))
    return policy, returned, key, _sdk(gateway, key)


def _sdk(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def _streamed(stream) -> tuple[str, dict, str, dict]:
    """(content, tool calls by index, finish reason, usage) from a chunk stream."""
    text, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            text += delta.content or ""
            for tc in delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = tc.id or c["id"]
                if tc.function is not None:
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return text, calls, finish, usage


def test_tool_calls_round_trip_through_the_sdk_and_merge_into_one_segment(gateway,
                                                                          tiny_model):
    policy, returned, key, sdk = scripted_job(gateway, tiny_model, {
        "ls": [CALL, CALL, "There are two files."]})
    try:
        assert [m.id for m in sdk.models.list()] == ["tiny"]
        messages = [{"role": "system", "content": "You run commands."},
                    {"role": "user", "content": "[case:ls] What is here?"}]
        first = sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "bash" and call.function.arguments == '{"command": "ls -1"}'
        assert first.usage.completion_tokens == len(returned[0].token_ids)
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "a.py\nb.py"}]
        # The second call streams; its tool call's arguments come in deltas.
        text, calls, finish, usage = _streamed(sdk.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, stream=True,
            stream_options={"include_usage": True}))
        assert finish == "tool_calls" and text == ""
        assert calls[0]["name"] == "bash" and calls[0]["arguments"] == '{"command": "ls -1"}'
        assert usage.completion_tokens == len(returned[1].token_ids)
        messages += [{"role": "assistant", "content": None, "tool_calls": [{
            "id": calls[0]["id"], "type": "function", "function": {
                "name": "bash", "arguments": calls[0]["arguments"]}}]},
                     {"role": "tool", "tool_call_id": calls[0]["id"], "content": "a.py\nb.py"}]
        last = sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        assert last.choices[0].message.content == "There are two files."
        assert last.choices[0].finish_reason == "stop"
    finally:
        sdk.close()
        policy.kill()
    _closed(gateway, key, returned, calls=3, merged=2)


def test_a_free_conversation_with_the_tiny_model_is_captured_token_exact(gateway, tiny_model,
                                                                         dev_server):
    returned: list = []
    job = _job(tiny_model, dev_server, returned, {"temperature": 1.0, "max_tokens": 12,
                                                  "seed": 7})
    key = gateway.open_job(job)
    sdk = _sdk(gateway, key)
    try:
        messages = [{"role": "user", "content": "Say something."}]
        for turn in range(4):
            if turn % 2:
                text, _, finish, _ = _streamed(sdk.chat.completions.create(
                    model="tiny", messages=messages, stream=True, max_tokens=400,
                    temperature=0.3))
            else:
                answer = sdk.chat.completions.create(model="tiny", messages=messages)
                text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
            assert finish in ("stop", "length")
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"And then {turn}?"}]
    finally:
        sdk.close()
    out = gateway.close_job(key).result()
    assert out["capture"]["segments"] == 1 and out["capture"]["merged"] == 3
    # The job's sampling won: temperature 1 and 12 tokens, the harness's asks recorded.
    assert {(o["field"], o["asked"], o["used"]) for o in out["capture"]["sampling_overrides"]} \
        == {("temperature", 0.3, 1.0), ("max_tokens", 400, 12)}
    (seg,) = out["segments"]
    mask = seg["response_mask"]
    assert sampled_ids(seg) == [t for g in returned for t in g.token_ids]
    full = seg["prompt_ids"] + seg["response_ids"]
    forced = teacher_forced_logprobs(tiny_model, full)[len(seg["prompt_ids"]):]
    errors = [abs(forced[i] - seg["response_logprobs"][i]) for i, m in enumerate(mask) if m]
    assert errors and max(errors) < 1e-3


def test_keys_belong_to_one_running_job_and_errors_come_in_openais_shape(gateway,
                                                                        tiny_model):
    policy = PolicyServer(planner=text_planner(str(tiny_model), {}))
    a = gateway.open_job(_job(tiny_model, policy.url, [], {}))
    b = gateway.open_job(_job(tiny_model, policy.url, [], {}))
    try:
        assert a != b
        with _sdk(gateway, "prorl-not-a-key") as sdk, pytest.raises(openai.AuthenticationError):
            sdk.models.list()
        with _sdk(gateway, a) as sdk:
            with pytest.raises(openai.BadRequestError) as bad:
                sdk.chat.completions.create(model="tiny", messages=[])
            assert bad.value.body["param"] == "messages"
            with pytest.raises(openai.BadRequestError) as bad:
                sdk.chat.completions.create(model="tiny", temperature=9,
                                            messages=[{"role": "user", "content": "x"}])
            assert bad.value.body["param"] == "temperature"
            assert sdk.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}]).choices
        gateway.close_job(a)
        with _sdk(gateway, a) as sdk, pytest.raises(openai.AuthenticationError):
            sdk.models.list()  # the job ended: its key is dead
        with _sdk(gateway, b) as sdk:  # the other job's key still works
            assert [m.id for m in sdk.models.list()] == ["tiny"]
    finally:
        policy.kill()


def test_a_flood_of_calls_gets_429_and_the_episode_goes_on(gateway, tiny_model):
    """More calls of one job in flight at once than the gateway queues: the rest get 429
    (the SDK's RateLimitError), and every call it took is served in turn."""
    from concurrent.futures import ThreadPoolExecutor

    from prorl_farm.gateway.server import MAX_PENDING_CALLS

    policy = PolicyServer(delay_s=0.3, planner=text_planner(str(tiny_model), {}))
    key = gateway.open_job(_job(tiny_model, policy.url, [], {}))

    def call(_):
        with _sdk(gateway, key) as sdk:
            try:
                sdk.chat.completions.create(model="tiny", messages=[
                    {"role": "user", "content": "hi"}])
                return "served"
            except openai.RateLimitError as e:
                assert e.body["code"] == "rate_limit_exceeded"
                return "429"

    try:
        with ThreadPoolExecutor(MAX_PENDING_CALLS + 6) as pool:
            outcomes = list(pool.map(call, range(MAX_PENDING_CALLS + 6)))
    finally:
        policy.kill()
    assert outcomes.count("429") >= 1 and outcomes.count("served") >= MAX_PENDING_CALLS
    assert gateway.close_job(key).result()["capture"]["calls"] == outcomes.count("served")
