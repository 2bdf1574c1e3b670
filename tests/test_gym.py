"""The farm as a NeMo Gym agent server (`prorl-farm gym`), on real pools behind the API
under gunicorn, with a scripted policy: Gym's math rows (``expected_answer``) through
``/run`` are ``math`` jobs whose model calls its ``python`` tool then answers; each answer is
the row with Gym's ``response`` (per model call its items, the last with the exact
``prompt_token_ids``/``generation_token_ids``/``generation_log_probs`` the farm stored,
tool results as ``function_call_output``) and the farm's reward; NeMo RL's prefix rule
holds. A failed job is masked with its failure, reward null (never 0). Bad rows are 422 in
FastAPI's shape with the field named, and nothing is enqueued. Many rows at once are
coalesced into few submits and waited on by one long-poll. ``/aggregate_metrics`` and
Gym's session routes answer in Gym's shapes.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
import sys

import pytest
import requests

from prorl_farm.trainer import FarmClient
from tests.farm import ROOT, free_port, http_farm, stop_process, wait_until
from tests.policy_server import PolicyServer, text_planner, tool_call

pytestmark = pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")

PLANS = {
    "sq": [tool_call("python", code="print(7 * 7)"), "So it is \\boxed{49}."],
    "sq-wrong": ["It is \\boxed{48}."],
}


def math_row(case: str, answer: str = "49", **extra) -> dict:
    return {"responses_create_params": {
        "input": [{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": f"[case:{case}] What is 7 squared?"}],
        "temperature": 1.0, "top_p": 1.0, "max_output_tokens": 64},
        "question": "What is 7 squared?", "expected_answer": answer,
        "agent_ref": {"type": "responses_api_agents", "name": "prorl_farm"},
        "_ng_task_index": 0, "_ng_rollout_index": 0, **extra}


@pytest.fixture(scope="module")
def gym_farm(redis_server, tiny_model, tmp_path_factory):
    """(gym server URL, farm client, policy server)."""
    log_dir = tmp_path_factory.mktemp("gym")
    server = PolicyServer(planner=text_planner(str(tiny_model), PLANS))
    try:
        with http_farm(redis_server.url, log_dir, "gym", run_concurrency=16) as (url, env):
            farm = FarmClient(url)
            for b in farm.backends():
                farm.unregister_backend(b["id"])
            farm.register_backend(server.url, "vllm", "tiny", str(tiny_model), capacity=32,
                                  policy_version=2)
            port = free_port()
            log = open(log_dir / "gym.log", "ab")  # noqa: SIM115
            gym = subprocess.Popen([sys.executable, "-m", "prorl_farm.cli", "gym", "--port",
                                    str(port), "--farm", url], env=env, cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
            base = f"http://127.0.0.1:{port}"
            try:
                wait_until(lambda: _up(base), 30, 0.1, "gym server")
                yield base, farm, server
            finally:
                stop_process(gym)
                log.close()
    finally:
        server.kill()


def _up(base: str) -> bool:
    try:
        return requests.get(base + "/healthz", timeout=1).status_code == 200
    except OSError:
        return False


def _batches(farm: FarmClient) -> int:
    return len(farm._call("GET", "/v1/batches?limit=1000")["batches"])


def test_math_rows_come_back_token_exact_with_the_farms_reward(gym_farm):
    base, farm, _ = gym_farm
    rows = [math_row("sq"), math_row("sq-wrong")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda row: requests.post(base + "/run", json=row, timeout=120),
                                rows))
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    right, wrong = (a.json() for a in answers)
    assert (right["reward"], wrong["reward"]) == (1.0, 0.0)
    for row, out in zip(rows, (right, wrong)):
        assert {k: out[k] for k in row} == row  # the row comes back as sent
        assert out["mask_sample"] is False
        job = farm.job(out["prorl_job_id"])
        assert job["reward"] == out["reward"]
        t = job["result"]
        trained = [i for i in out["response"]["output"] if i.get("generation_token_ids")]
        assert len(trained) == len(t["turns"])
        seen: list[int] = []
        for item, turn in zip(trained, t["turns"]):
            lo, hi = turn["offset"], turn["offset"] + turn["generated"]
            assert item["prompt_token_ids"] == t["prompt_ids"] + t["response_ids"][:lo]
            assert item["generation_token_ids"] == t["response_ids"][lo:hi]
            assert item["generation_log_probs"] == t["response_logprobs"][lo:hi]
            # NeMo RL's rule: each turn's prompt begins with every token seen before it.
            assert item["prompt_token_ids"][:len(seen)] == seen
            seen = item["prompt_token_ids"] + item["generation_token_ids"]
    types = [i["type"] for i in right["response"]["output"]]
    assert types == ["function_call", "function_call_output", "message"], types
    call, result, answer = right["response"]["output"]
    assert call["name"] == "python" and result["call_id"] == call["call_id"]
    assert "49" in result["output"] and "\\boxed{49}" in answer["content"][0]["text"]


def test_a_failed_job_is_masked_never_a_zero_reward(gym_farm):
    base, farm, _ = gym_farm
    row = {"responses_create_params": {"input": "x"},
           "prorl": {"handler": "synthetic", "instance": {"fail_stage": "eval"}}}
    out = requests.post(base + "/run", json=row, timeout=60).json()
    assert out["mask_sample"] is True and out["reward"] is None
    assert out["failure_kind"] == "agent_run_error" and out["failure_reason"]
    assert farm.job(out["prorl_job_id"])["state"] == "failed"


@pytest.mark.parametrize("row, loc", [
    ({"responses_create_params": {"input": "x", "temprature": 1}, "expected_answer": "1"},
     ["body", "responses_create_params", "temprature"]),
    ({"expected_answer": "1"}, ["body", "responses_create_params"]),
    ({"responses_create_params": {"input": "x"}}, ["body", "expected_answer"]),
    ({"responses_create_params": {"input": "x", "tools": [{"type": "function", "name": "f"}]},
      "expected_answer": "1"}, ["body", "responses_create_params", "tools"]),
    ({"responses_create_params": {"input": "x", "temperature": 99}, "expected_answer": "1"},
     ["body", "responses_create_params", "temperature"]),
    ({"responses_create_params": {"input": "x"},
      "prorl": {"handler": "math", "instance": {"problem": "p"}}},
     ["body", "prorl", "instance", "answer"]),
    ({"responses_create_params": {"input": "x"},
      "prorl": {"handler": "nope", "instance": {}}}, ["body", "prorl", "handler"]),
])
def test_a_bad_row_is_a_422_naming_the_field_and_nothing_is_enqueued(gym_farm, row, loc):
    base, farm, _ = gym_farm
    before = _batches(farm)
    resp = requests.post(base + "/run", json=row, timeout=30)
    assert resp.status_code == 422, resp.text
    assert loc in [d["loc"] for d in resp.json()["detail"]], resp.json()
    assert _batches(farm) == before


def test_a_bad_row_among_good_ones_fails_alone(gym_farm):
    """Rows coalesced into one submit: the farm refuses one instance; the others run."""
    base, _, _ = gym_farm
    good = {"responses_create_params": {"input": "x"},
            "prorl": {"handler": "synthetic", "instance": {"reward": 0.5}}}
    bad = {"responses_create_params": {"input": "x"},
           "prorl": {"handler": "synthetic", "instance": {"reward": "high"}}}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda row: requests.post(base + "/run", json=row, timeout=60),
                                [good, bad] * 4))
    assert [a.status_code for a in answers] == [200, 422] * 4
    assert all(a.json()["reward"] == 0.5 for a in answers[::2])
    assert all(d["loc"] == ["body", "prorl", "instance", "reward"]
               for a in answers[1::2] for d in a.json()["detail"])


def test_many_rows_at_once_are_few_submits(gym_farm):
    base, farm, _ = gym_farm
    before = _batches(farm)
    row = {"responses_create_params": {"input": "x"},
           "prorl": {"handler": "synthetic", "instance": {"reward": 1.0}}}
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda _: requests.post(base + "/run", json=row, timeout=120),
                                range(128)))
    assert all(a.status_code == 200 and a.json()["reward"] == 1.0 for a in answers)
    assert len({a.json()["prorl_job_id"] for a in answers}) == 128
    assert _batches(farm) - before < 64  # coalesced: rows that came together, one submit


def test_aggregate_metrics_and_sessions_in_gyms_shapes(gym_farm):
    base, _, _ = gym_farm
    rows = [{"_ng_task_index": 0, "reward": 1.0}, {"_ng_task_index": 0, "reward": 0.0},
            {"_ng_task_index": 1, "reward": 1.0},
            {"_ng_task_index": 1, "reward": None, "mask_sample": True}]
    out = requests.post(base + "/aggregate_metrics", json={"verify_responses": rows}).json()
    assert out["agent_metrics"]["mean/reward"] == pytest.approx(2 / 3)
    assert out["agent_metrics"]["masked"] == 1
    assert out["key_metrics"] == {"mean/reward": pytest.approx(2 / 3)}
    assert sorted(g["mean/reward"] for g in out["group_level_metrics"]) == [0.5, 1.0]
    seed = {"agent_session_id": "s1", "episode_id": {"rollout_id": "r", "attempt": 0},
            "task_id": {"taskset": "t", "index": 0}}
    for _ in range(2):  # idempotent
        assert requests.post(base + "/v1/agent_sessions", json=seed).json() == \
            {"agent_session_id": "s1"}
    closed = requests.post(base + "/v1/agent_sessions/close", json={
        "agent_session_id": "s1", "episode_id": seed["episode_id"]})
    assert closed.json()["agent_session_id"] == "s1"
    assert requests.post(base + "/v1/agent_sessions", json=seed).status_code == 409
