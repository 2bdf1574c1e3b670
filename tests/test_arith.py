"""The ``arith`` handler and the character-level tiny tokenizer it is learned with."""

from __future__ import annotations

import pytest

from prorl_farm.context import JobContext
from prorl_farm.errors import InvalidInstance
from prorl_farm.handlers.arith import ArithHandler
from prorl_farm.trainer import FarmClient
from tests.farm import http_farm
from tests.policy_server import PolicyServer


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    from prorl_farm.dev.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("char-model"), chars=True, small=True)


def _ctx(instance: dict, result: dict | None = None) -> JobContext:
    return JobContext(job_id="j", batch_id="b", stage="eval", token="t", node="n",
                      instance=instance, sampling={}, result=result)


def _result(answer: str, finish: str = "stop") -> dict:
    return {"messages": [{"role": "user", "content": "3+4"},
                         {"role": "assistant", "content": answer}],
            "turns": [{"finish_reason": finish}]}


@pytest.mark.parametrize("answer,finish,reward", [
    ("7", "stop", 1.0), ("7", "length", 0.0), ("07", "stop", 0.0), ("7 ", "stop", 0.0),
    ("8", "stop", 0.0), ("", "stop", 0.0), ("7\n7", "stop", 0.0)])
def test_reward_only_for_the_exact_sum_then_the_end_of_turn(answer, finish, reward):
    h = ArithHandler()
    inst = h.validate_instance({"a": 3, "b": 4})
    assert h.eval(_ctx(inst, _result(answer, finish)))["reward"] == reward


def test_instances_are_single_digits_and_the_reference_earns_1():
    h = ArithHandler()
    for bad in ({"a": 10, "b": 1}, {"a": 1}, {"a": "1", "b": 2}, {"a": 1, "b": 2, "c": 3}):
        with pytest.raises(InvalidInstance):
            h.validate_instance(bad)
    inst = h.validate_instance({"a": 9, "b": 8})
    assert h.eval(_ctx(inst, h.reference(_ctx(inst))))["reward"] == 1.0


def test_the_char_tokenizer_is_one_token_per_character(char_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(char_model))
    assert len(tok) < 50
    text = "user\n3+4 = 7?"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "3+4"}],
                                       add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\n3+4<|im_end|>\n<|im_start|>assistant\n"


def test_arith_through_the_farm_token_exact(redis_server, r, tmp_path, char_model):
    """A scripted policy answers right when a is even: rewards follow, and the sampled IDs
    are exactly what the server returned, the end token included."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(char_model))
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def planner(prompt: list[int], max_tokens: int):
        text = tok.decode(prompt)
        a, b = (int(x) for x in text.split("user\n")[1].split("<")[0].split("+"))
        answer = str(a + b if a % 2 == 0 else a + b + 1)
        return tok.encode(answer, add_special_tokens=False) + [end], "stop"

    server = PolicyServer(planner=planner)
    try:
        with http_farm(redis_server.url, tmp_path, "arith") as (url, _):
            farm = FarmClient(url)
            farm.register_backend(server.url, "vllm", "char", str(char_model), capacity=8,
                                  policy_version=3)
            instances = [{"a": a, "b": b} for a in range(4) for b in (5, 9)]
            sub = farm.submit("arith", instances, n=2)
            jobs = {j["id"]: j for j in farm.iter_results(sub["batch_id"], timeout_s=60)}
            assert set(jobs) == set(sub["job_ids"])
            for job_id, job in jobs.items():
                inst = instances[job["instance_index"]]
                assert job["state"] == "done"
                assert job["reward"] == (1.0 if inst["a"] % 2 == 0 else 0.0)
                full = farm.job(job_id)["result"]
                assert full["response_ids"][-1] == end and full["policy_version"] == 3
                assert sum(full["response_mask"]) == len(full["response_ids"])
    finally:
        server.kill()
