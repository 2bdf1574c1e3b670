"""The agent loop through the real pipeline (API, pools, sandboxes), driven by a scripted
policy that plays planned texts tokenised by the test tokenizer: tool calls, malformed
calls, limits, and the math handler's grading."""

from __future__ import annotations

import pytest

from prorl_farm.agent.parsers import (
    HermesParser,
    Llama3JsonParser,
    Qwen3CoderParser,
    split_reasoning,
)
from tests.farm import run_batch, scripted_farm, use_only_backend, wait_until
from tests.policy_server import PolicyServer, text_planner
from tests.policy_server import tool_call as call

pytestmark = pytest.mark.slow


PLANS = {
    "good": [call("python", code="print(6 * 7)"), "So the answer is \\boxed{42}."],
    "bad": [call("python", code="print(6 * 7)"), "I think it is \\boxed{41}."],
    "hedge": ["It is \\boxed{41, 42, 43}."],
    "late-box": ["Maybe \\boxed{42}? No: the answer is \\boxed{41}."],
    "malformed": ["<tool_call>{not json</tool_call>", call("calculator", x=1),
                  call("python", cod="1"), "Done: \\boxed{42}."],
    "loop": [call("python", code="1 + 1")],  # calls forever
    "slow-tool": [call("python", code="import time; time.sleep(30)"), "\\boxed{42}"],
    "chatty": ["blah " * 40 + "\\boxed{42}"],
    "dawdle": [call("python", code="import time; time.sleep(0.5)")],  # until the deadline
    "long-output": [call("python", code="print('a' * 3000 + 'b' * 3000)"), "\\boxed{42}"],
    "two-calls": [call("python", code="x = 6") + "\n" + call("python", code="print(x * 7)"),
                  "\\boxed{42}"],
}


@pytest.fixture(scope="module")
def agent_farm(redis_server, tmp_path_factory, tiny_model):
    with scripted_farm(redis_server.url, tmp_path_factory.mktemp("agent"), str(tiny_model),
                       PLANS, "agent") as (client, server):
        yield client, server, tiny_model


def _register(client, server, tiny_model) -> str:
    return use_only_backend(client, url=server.url, kind="vllm", model="tiny",
                            tokenizer=str(tiny_model), capacity=64, policy_version=7)


def _math(client, cases: list[str], sampling: dict | None = None, deadline_s: float = 120,
          **extra) -> list[dict]:
    instances = [{"problem": f"[case:{c}] What is 6 times 7?", "answer": "42", **extra}
                 for c in cases]
    return run_batch(client, {"handler": "math", "instances": instances,
                              "sampling": sampling or {"max_tokens": 128},
                              "deadline_s": deadline_s})


def _prefix_exact(job: dict, server: PolicyServer) -> None:
    """Every prompt the policy received is prompt_ids + response_ids[:offset] of its turn."""
    t = job["result"]
    prompts = server.prompts[job["id"]]
    assert len(prompts) == len(t["turns"])
    for turn, prompt in zip(t["turns"], prompts):
        assert prompt == t["prompt_ids"] + t["response_ids"][:turn["offset"]]
    assert len(t["response_ids"]) == len(t["response_mask"]) == len(t["response_logprobs"])


def test_math_episodes_with_tools_are_graded_on_the_final_answer(agent_farm, r):
    client, server, tiny_model = agent_farm
    _register(client, server, tiny_model)
    good, bad, hedge, late, two = _math(client, ["good", "bad", "hedge", "late-box",
                                                 "two-calls"])
    for job in (good, bad, hedge, late, two):
        assert job["state"] == "done", job["failure"]
        _prefix_exact(job, server)
        assert job["result"]["stats"]["end_reason"] == "answered"
    assert good["reward"] == 1.0 and good["result"]["stats"]["calls"] == {"python": 1}
    tool_turn = good["result"]["messages"][-2]
    assert tool_turn["role"] == "tool" and tool_turn["content"].strip() == "42"
    assert good["result"]["turns"][0]["policy_version"] == 7
    assert good["policy_version"] == 7 and good["result"]["policy_version"] == 7
    # The tools were offered through the chat template, and the answer is not in RUN's view.
    prompt_text = good["result"]["messages"][0]["content"]
    assert "42" not in prompt_text
    assert bad["reward"] == 0.0 and bad["result"]["eval"]["verdict"] == "wrong"
    assert hedge["reward"] == 0.0 and "several" in hedge["result"]["eval"]["verdict"]
    assert late["reward"] == 0.0  # only the last box counts
    assert two["reward"] == 1.0 and two["result"]["stats"]["calls"] == {"python": 2}
    # Every sandbox is gone.
    wait_until(lambda: not r.hlen("prorl:sandboxes:testnode"), 10, 0.1, "sandboxes stopped")


def test_malformed_calls_and_limits_end_episodes_as_they_say(agent_farm, r):
    client, server, tiny_model = agent_farm
    _register(client, server, tiny_model)
    malformed, loop = _math(client, ["malformed", "loop"], max_turns=4)
    assert malformed["reward"] == 1.0
    stats = malformed["result"]["stats"]
    assert stats["malformed_calls"] == 3 and stats["end_reason"] == "answered"
    errors = [m["content"] for m in malformed["result"]["messages"] if m["role"] == "tool"]
    assert any("not valid JSON" in e for e in errors)
    assert any("unknown tool 'calculator'" in e for e in errors)
    assert any("'code' must be a string" in e for e in errors)
    assert loop["result"]["stats"]["end_reason"] == "max_turns"
    assert loop["result"]["stats"]["turns"] == 4 and loop["reward"] == 0.0
    [slow] = _math(client, ["slow-tool"], call_timeout_s=1.0)
    assert slow["reward"] == 1.0
    observation = [m for m in slow["result"]["messages"] if m["role"] == "tool"][0]
    assert "timed out" in observation["content"]
    assert slow["result"]["stats"]["tool_s"] < 20
    [tokens] = _math(client, ["loop"], sampling={"max_tokens": 64, "max_total_tokens": 60})
    assert tokens["result"]["stats"]["end_reason"] == "max_tokens"
    [context] = _math(client, ["loop"], sampling={"max_tokens": 64, "context_length": 420})
    assert context["result"]["stats"]["end_reason"] == "context"
    t = context["result"]
    assert len(t["prompt_ids"]) + len(t["response_ids"]) < 420
    [chatty] = _math(client, ["chatty"], sampling={"max_tokens": 16})
    assert chatty["result"]["stats"]["end_reason"] == "max_tokens" and chatty["reward"] == 0.0
    # A turn the context cut (the room left nearer than max_tokens) says so.
    room = len(chatty["result"]["prompt_ids"]) + 12
    [cut] = _math(client, ["chatty"], sampling={"max_tokens": 64, "context_length": room})
    assert cut["result"]["stats"]["end_reason"] == "context", cut["result"]["stats"]
    assert 0 < len(cut["result"]["response_ids"]) <= 12
    [long] = _math(client, ["long-output"], observation_chars=600)
    [observation] = [m["content"] for m in long["result"]["messages"] if m["role"] == "tool"]
    assert observation.startswith("a" * 400) and observation.rstrip().endswith("b" * 150)
    assert "characters omitted" in observation and len(observation) < 700
    assert long["reward"] == 1.0
    # The deadline passes mid-episode: not graded (no reward, never 0); the episode so far
    # is kept, end reason `timeout`.
    [late] = _math(client, ["dawdle"], deadline_s=10, max_turns=100)
    assert late["state"] == "failed" and late["reward"] is None
    assert late["failure"]["kind"] == "timeout"
    assert late["result"]["stats"]["end_reason"] == "timeout"
    assert 2 <= late["result"]["stats"]["turns"] < 100
    for job in (malformed, loop, slow, tokens, context, chatty, long, late):
        _prefix_exact(job, server)
    wait_until(lambda: not r.hlen("prorl:sandboxes:testnode"), 10, 0.1, "sandboxes stopped")


def test_parsers():
    hermes = HermesParser().parse('a<tool_call>{"name": "bash", "arguments": {"command": "ls"}}'
                                  '</tool_call>b<tool_call>{"name": 3}</tool_call>'
                                  '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}')
    assert [(c.name, c.arguments) for c in hermes.calls] == [("bash", {"command": "ls"}),
                                                             ("x", {"a": 1})]
    assert len(hermes.errors) == 1
    assert not HermesParser().parse("just an answer \\boxed{1}").any
    llama = Llama3JsonParser().parse('<|python_tag|>{"name": "python", "parameters": '
                                     '{"code": "1"}}; {"name": "bash", "parameters": '
                                     '{"command": "ls"}}<|eom_id|>')
    assert [c.name for c in llama.calls] == ["python", "bash"] and not llama.errors
    assert not Llama3JsonParser().parse("The answer is 4.").any
    assert Llama3JsonParser().parse('{"name": "python", "parameters": {').errors
    assert Llama3JsonParser().without_calls('Let me run it.<|python_tag|>{"name": "python", '
                                    '"parameters": {}}') == "Let me run it."
    coder = ("I will look.\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n"
             "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=edit>\n"
             "<parameter=line>\n12\n</parameter>\n<parameter=text>\n  a\n  b\n</parameter>"
             "\n</function>\n</tool_call>")
    parsed = Qwen3CoderParser().parse(coder)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("bash", {"command": "ls -la"}), ("edit", {"line": 12, "text": "  a\n  b"})]
    assert Qwen3CoderParser().without_calls(coder) == "I will look."
    assert Qwen3CoderParser().parse("<tool_call>oops</tool_call>").errors
    assert split_reasoning("<think>\nhmm, 2+2\n</think>\n\nIt is 4.") == ("hmm, 2+2",
                                                                           "It is 4.")
    assert split_reasoning("hmm</think>It is 4.") == ("hmm", "It is 4.")
    assert split_reasoning("It is 4.") == ("", "It is 4.")


STEM_PLANS = {
    "choice-right": ["The force balances at B, so \\boxed{B}"],
    "choice-wrong": ["\\boxed{C}"],
    "choice-many": ["\\boxed{B or C}"],
    "choice-line": ["Reasoning...\nAnswer: B"],
    "value-right": ["About \\boxed{9.8}"],
    "value-wrong": ["\\boxed{10.5}"],
}


def test_stem_questions_are_graded_by_choice_or_value(agent_farm):
    client, server, tiny_model = agent_farm
    server.planner = text_planner(str(tiny_model), {**PLANS, **STEM_PLANS})
    try:
        _register(client, server, tiny_model)
        choices = ["a lever", "a pulley", "a wedge"]
        instances = [{"question": f"[case:{c}] Which one?", "choices": choices, "answer": "B"}
                     for c in ("choice-right", "choice-wrong", "choice-many", "choice-line")]
        instances += [{"question": f"[case:{c}] g on Earth in m/s^2?", "answer": "9.8"}
                      for c in ("value-right", "value-wrong")]
        jobs = run_batch(client, {"handler": "stem", "instances": instances,
                                  "sampling": {"max_tokens": 64}}, 60)
        assert [j["reward"] for j in jobs] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], \
            [(j["failure"], (j["result"] or {}).get("eval")) for j in jobs]
        prompt = jobs[0]["result"]["messages"][0]["content"]
        assert "B. a pulley" in prompt and "answer" not in jobs[0]["result"]  # RUN's view
    finally:
        server.planner = text_planner(str(tiny_model), PLANS)
