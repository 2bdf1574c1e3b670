"""The farm as a NeMo Gym agent server (`prorl-farm gym`), on real pools behind the API
under gunicorn, with a scripted policy: Gym's math rows (``expected_answer``) through
``/run`` are ``math`` jobs whose model calls its ``python`` tool then answers; each answer is
the row with Gym's ``response`` (per model call its items, the last with the exact
``prompt_token_ids``/``generation_token_ids``/``generation_log_probs`` the farm stored,
tool results as ``function_call_output``) and the farm's reward; NeMo RL's prefix rule
holds. A failed job is masked with its failure, reward null (never 0). Bad rows are 422 in
FastAPI's shape with the field named, and nothing is enqueued. Many rows at once go into
the server's one farm batch, waited on by one long-poll. ``/aggregate_metrics`` and Gym's
session routes answer in Gym's shapes.

Then NeMo Gym's own code (0.7.0, in .venv-gym: `make gym`; skipped where it is not
installed, failed where REQUIRE_GYM=1 as `make test` sets): Gym's head server serves a
config with the farm behind both the agent and its ``legacy_agent`` environment server;
``ng_collect_rollouts`` runs 64 rows of two task types (exit 0, no failure, every row valid
as Gym's ``BaseVerifyResponse``, equal to its farm job); rows as NeMo RL sends them through
Gym's ``RolloutCollectionHelper.run_examples`` and NeMo RL's postprocess layout give the
tokens, loss mask and logprobs the farm's VeRL adapter gives for the same jobs.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from prorl_farm.trainer import FarmClient
from tests import gym_datasets
from tests.farm import ROOT, free_port, http_farm, require_venv, stop_process, wait_until
from tests.policy_server import PolicyServer, text_planner, tool_call

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")]

PLANS = {
    "sq": [tool_call("python", code="print(7 * 7)"), "So it is \\boxed{49}."],
    "sq-wrong": ["It is \\boxed{48}."],
    "hi": ["The answer is 42."],
}
GYM_PYTHON = ROOT / ".venv-gym" / "bin" / "python"
GYM_SIDE = str(ROOT / "tests" / "gym_side.py")


COUNTER = re.compile(r"add (\d+) then add (\d+) then get the count")
# What a policy that reaches for the grader tries (each a tool the row does not declare).
FORGE = [tool_call("verify", expected_count=0), tool_call("seed_session", initial_count=99),
         tool_call("../verify"), tool_call("increment_counter/../verify"),
         tool_call("close_session"), tool_call("aggregate_metrics"), "It is done."]


def planner(tokenizer_path: str):
    """The [case:] plans (text_planner), and a policy for the rows of Gym's
    example_session_state_mgmt dataset ("add A then add B then get the count"): it adds A,
    adds B, reads the counter, answers; with [case:forge] it calls the grader's routes.
    Rows of the Gym environment a test replays (``plan.replay``, tests/gym_datasets.py)
    get their recorded answers."""
    from transformers import AutoTokenizer

    cases = text_planner(tokenizer_path, {**PLANS, "forge": FORGE})
    tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    replay = gym_datasets.Replay(tokenizer_path)

    def plan(prompt: list[int], max_tokens: int):
        replayed = replay(prompt, max_tokens) if replay.cases else None
        if replayed is not None:
            return replayed
        text = tok.decode(prompt, skip_special_tokens=False)
        m = COUNTER.search(text)
        if m is None or "[case:" in text:
            return cases(prompt, max_tokens)
        steps = [tool_call("increment_counter", count=int(m[1])),
                 tool_call("increment_counter", count=int(m[2])),
                 tool_call("get_counter_value"), "That is the count."]
        turn = max(0, text.count("<|im_start|>assistant") - 1)
        ids = [*tok.encode(steps[min(turn, len(steps) - 1)], add_special_tokens=False), end]
        return (ids, "stop") if len(ids) <= max_tokens else (ids[:max_tokens], "length")

    plan.replay = replay
    return plan


def math_row(case: str, answer: str = "49", **extra) -> dict:
    return {"responses_create_params": {
        "input": [{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": f"[case:{case}] What is 7 squared?"}],
        "temperature": 1.0, "top_p": 1.0, "max_output_tokens": 64},
        "question": "What is 7 squared?", "expected_answer": answer, "prorl_grader": "math",
        "agent_ref": {"type": "responses_api_agents", "name": "prorl_farm"},
        "_ng_task_index": 0, "_ng_rollout_index": 0, **extra}


@pytest.fixture(scope="module")
def gym_farm(redis_server, tiny_model, tmp_path_factory):
    """(gym server URL, farm client, policy server)."""
    import redis

    from tests.conftest import _clear

    # Backends an earlier module of this worker left in the shared Redis: a job pinned to
    # one would fail over to ours and be refused (another tokenizer).
    left = redis.Redis.from_url(redis_server.url, decode_responses=True)
    _clear(left)
    left.close()
    log_dir = tmp_path_factory.mktemp("gym")
    plan = planner(str(tiny_model))
    server = PolicyServer(planner=plan)
    server.replay = plan.replay
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


def _up(base: str, path: str = "/healthz") -> bool:
    try:
        return requests.get(base + path, timeout=1).status_code == 200
    except OSError:
        return False


def _jobs(farm: FarmClient) -> int:
    """Jobs the farm holds, over every batch."""
    return sum(b["total"] for b in farm._call("GET", "/v1/batches?limit=1000")["batches"])


def _check_against_the_farm(farm: FarmClient, out: dict) -> dict:
    """The row's ids, logprobs and reward are what the farm stored for its job, and each
    turn's prompt extends everything before it (NeMo RL's rule)."""
    job = farm.job(out["prorl_job_id"])
    assert job["state"] == "done" and out["reward"] == job["reward"]
    t = job["result"]
    trained = [i for i in out["response"]["output"] if i.get("generation_token_ids")]
    assert len(trained) == len(t["turns"])
    seen: list[int] = []
    for item, turn in zip(trained, t["turns"]):
        lo, hi = turn["offset"], turn["offset"] + turn["generated"]
        assert item["prompt_token_ids"] == t["prompt_ids"] + t["response_ids"][:lo]
        assert item["generation_token_ids"] == t["response_ids"][lo:hi]
        assert item["generation_log_probs"] == t["response_logprobs"][lo:hi]
        assert item["prompt_token_ids"][:len(seen)] == seen
        seen = item["prompt_token_ids"] + item["generation_token_ids"]
    return job


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
        _check_against_the_farm(farm, out)
    types = [i["type"] for i in right["response"]["output"]]
    assert types == ["function_call", "function_call_output", "message"], types
    call, result, answer = right["response"]["output"]
    assert call["name"] == "python" and result["call_id"] == call["call_id"]
    assert "49" in result["output"] and "\\boxed{49}" in answer["content"][0]["text"]


def test_a_row_holding_a_conversation_answers_with_the_models_own_text(gym_farm,
                                                                      broken_verifier):
    """A row whose input holds a conversation so far (earlier assistant messages, a function
    call and its output, as Gym's citation_if rows do): the answer's message is the model's
    call, not an earlier turn's, token-exact."""
    base, farm, _ = gym_farm
    row = {"responses_create_params": {"input": [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Look it up."},
        {"type": "function_call", "name": "web_search", "call_id": "c1",
         "arguments": "{\"query\": \"the answer\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "user", "content": "[case:hi] What is the answer?"}]},
        "prorl": {"resources_server": broken_verifier + "/ok"}}
    out = requests.post(base + "/run", json=row, timeout=60).json()
    assert out.get("reward") == 1.0, out
    [item] = out["response"]["output"]
    assert item["content"][0]["text"] == "The answer is 42."
    job = _check_against_the_farm(farm, out)
    roles = [m["role"] for m in job["result"]["messages"]]
    assert roles == ["user", "assistant", "user", "assistant", "tool", "user", "assistant"]
    assert job["result"]["messages"][3]["tool_calls"][0]["function"] == {
        "name": "web_search", "arguments": {"query": "the answer"}}


def test_a_failed_job_without_a_rollout_is_gyms_failure_record_never_a_reward(gym_farm):
    """A job that failed before its model generated: Gym's record of a rollout that did not
    happen (``_ng_failure_class``, no reward, the failure), which Gym's collector sets
    apart from the scored rows."""
    base, farm, _ = gym_farm
    row = {"responses_create_params": {"input": "x"},
           "prorl": {"handler": "synthetic", "instance": {"fail_stage": "eval"}}}
    out = requests.post(base + "/run", json=row, timeout=60).json()
    assert "reward" not in out and out["mask_sample"] is True
    assert out["_ng_failure_class"] == "agent_run_error" and "_ng_failure_terminal" not in out
    assert out["failure_kind"] == "verifier_error" and out["failure_reason"]
    assert out["response"]["status"] == "failed" and out["response"]["error"]["code"] == \
        "eval_error"
    assert farm.job(out["prorl_job_id"])["state"] == "failed"


class _Verifier:
    """A resources server whose verifier is down: seed_session answers, /verify is a 500
    (a judge that failed); under ``/masked`` its /verify answers a reward it masks in
    ``instance_config`` (as Gym's conversational_tool_use_simulation does), under ``/ok``
    a reward of 1."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from prorl_farm.dev.devserver import send_body

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, body = (200, b"{}") if self.path.endswith("/seed_session") else \
                    (200, b'{"reward": 0.0, "instance_config": {"mask_sample": true}}') \
                    if self.path == "/masked/verify" else \
                    (200, b'{"reward": 1.0}') if self.path == "/ok/verify" else \
                    (500, b'{"detail": "the judge is down"}')
                send_body(self, status, body)

        import threading

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def broken_verifier():
    v = _Verifier()
    yield v.url
    v.close()


def masked_row(server: str, i: int = 0) -> dict:
    """A tool-less row of an environment whose /verify fails after the model answered."""
    return {"responses_create_params": {"input": f"[case:hi] question {i}"},
            "prorl": {"resources_server": server}, "expected_answer": "42"}


def test_a_failed_job_that_generated_is_masked_with_its_real_tokens(gym_farm, broken_verifier):
    """A job whose model answered and whose verifier then failed: the row comes back with
    the tokens the farm stored, masked as Gym's verifiers mask one (``mask_sample`` at the
    top and in ``instance_config``, where NeMo RL reads it; the failure named), reward 0.0
    only because Gym's ``BaseVerifyResponse`` requires a float under the mask."""
    base, farm, _ = gym_farm
    out = requests.post(base + "/run", json=masked_row(broken_verifier), timeout=60).json()
    assert out["mask_sample"] is True and out["instance_config"] == {"mask_sample": True}
    assert out["reward"] == 0.0 and "_ng_failure_class" not in out
    assert out["failure_kind"] == "verifier_error" and "judge is down" in out["failure_reason"]
    job = farm.job(out["prorl_job_id"])
    assert (job["handler"], job["state"], job["reward"]) == ("gym", "failed", None)
    t = job["result"]
    [item] = [i for i in out["response"]["output"] if i.get("generation_token_ids")]
    assert item["prompt_token_ids"] == t["prompt_ids"]
    assert item["generation_token_ids"] == t["response_ids"]
    assert item["generation_log_probs"] == t["response_logprobs"]
    # A verdict masked in instance_config (where NeMo RL reads it) is no reward either.
    out = requests.post(base + "/run", json=masked_row(broken_verifier + "/masked"),
                        timeout=60).json()
    assert out["mask_sample"] is True and "masked its own verdict" in out["failure_reason"]
    assert farm.job(out["prorl_job_id"])["state"] == "failed"


@pytest.mark.parametrize("row, loc", [
    ({"responses_create_params": {"input": "x", "temprature": 1}, "expected_answer": "1"},
     ["body", "responses_create_params", "temprature"]),
    ({"expected_answer": "1"}, ["body", "responses_create_params"]),
    ({"responses_create_params": {"input": "x"}}, ["body", "prorl"]),
    # An expected_answer alone does not say how Gym's environment compares it.
    ({"responses_create_params": {"input": "x"}, "expected_answer": "B"},
     ["body", "prorl_grader"]),
    ({"responses_create_params": {"input": "x", "tools": [{"type": "function", "name": "f"}]},
      "expected_answer": "1", "prorl_grader": "math"},
     ["body", "responses_create_params", "tools"]),
    ({"responses_create_params": {"input": "x", "temperature": 99}, "expected_answer": "1",
      "prorl_grader": "math"}, ["body", "responses_create_params", "temperature"]),
    ({"responses_create_params": {"input": "x"},
      "prorl": {"handler": "math", "instance": {"problem": "p"}}},
     ["body", "prorl", "instance", "answer"]),
    ({"responses_create_params": {"input": "x"},
      "prorl": {"handler": "nope", "instance": {}}}, ["body", "prorl", "handler"]),
    # A Gym resources server's row: a tool named like one of the server's own routes would
    # let the policy call the grader; a tool that is not a function has nothing to run it.
    ({"responses_create_params": {"input": "x", "tools": [
        {"type": "function", "name": "verify", "parameters": {}}]},
      "prorl": {"resources_server": "http://127.0.0.1:9"}},
     ["body", "responses_create_params", "tools"]),
    ({"responses_create_params": {"input": "x", "tools": [
        {"type": "function", "name": "../verify", "parameters": {}}]},
      "prorl": {"resources_server": "http://127.0.0.1:9"}},
     ["body", "responses_create_params", "tools"]),
    ({"responses_create_params": {"input": "x", "tools": [{"type": "web_search"}]},
      "prorl": {"resources_server": "http://127.0.0.1:9"}},
     ["body", "responses_create_params", "tools"]),
    ({"responses_create_params": {"input": "x", "tools": [
        {"type": "function", "name": "f", "parameters": {}}]},
      "prorl": {"resources_server": "file:///etc/passwd"}},
     ["body", "prorl", "resources_server"]),
    # ... and the farm's workers POST only where its backends may be (PRORL_BACKEND_ALLOW).
    ({"responses_create_params": {"input": "x", "tools": [
        {"type": "function", "name": "f", "parameters": {}}]},
      "prorl": {"resources_server": "http://10.255.1.2:8080"}},
     ["body", "prorl", "resources_server"]),
])
def test_a_bad_row_is_refused_alone_naming_the_field_and_nothing_is_enqueued(gym_farm, row,
                                                                            loc):
    """A row the farm cannot take is answered as Gym's agents answer a rollout that did not
    happen (a terminal failure record, so Gym's collector sets it apart and goes on), its
    fields named as FastAPI's 422 would; nothing is enqueued."""
    base, farm, _ = gym_farm
    before = _jobs(farm)
    resp = requests.post(base + "/run", json=row, timeout=30)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["_ng_failure_class"] == "agent_run_error" and out["_ng_failure_terminal"]
    assert "reward" not in out and out["mask_sample"] is True
    assert loc in [d["loc"] for d in out["prorl_refused"]], out
    assert {k: out[k] for k in row} == row
    assert _jobs(farm) == before


_CALL = {"type": "function_call", "name": "search", "arguments": "{\"q\": \"x\"}",
         "call_id": "c1"}


@pytest.mark.parametrize("items, taken", [
    ("a question", True),
    ([{"role": "user", "content": "q"}], True),
    ([{"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                            "text": "be brief"}]},
      {"role": "user", "content": "q"}], True),
    # A conversation so far (citation_if, iheval): its calls, their outputs, its reasoning.
    ([{"role": "user", "content": "q"}, {"type": "reasoning", "summary": []}, _CALL,
      {"type": "function_call_output", "call_id": "c1", "output": [{"type": "output_text",
                                                                   "text": "found"}]},
      {"type": "function_call_output", "call_id": "c1", "output": {"hits": 2}},
      {"role": "assistant", "content": [{"type": "output_text", "text": "so"}]},
      {"role": "user", "content": "and?"}], True),
    ([], False),
    ([{"role": "tool", "content": "q"}], False),
    ([{"role": "user"}], False),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], False),
    ([{"type": "function_call", "arguments": "{}"}], False),  # no name
    ([{"type": "web_search_call", "id": "w"}], False),
    (["a string item"], False),
])
def test_the_published_row_schema_takes_a_row_exactly_when_the_farm_does(items, taken):
    """The ``gym`` task's row schema (published in the OpenAPI document) and the farm's
    own reading of a row's input agree: neither refuses what the other takes."""
    import jsonschema_rs

    from prorl_farm.handlers.gym import ROW_SCHEMA, GymInstance

    row = {"responses_create_params": {"input": items}}
    refused = GymInstance().validate({"server": "http://127.0.0.1:8000/", "row": row})
    assert jsonschema_rs.Draft4Validator(ROW_SCHEMA).is_valid(row) is taken
    assert (not refused) is taken, refused


def test_an_unreachable_resources_server_is_named_so_never_a_zero(gym_farm):
    """A ``gym`` row whose resources server cannot be reached: the job fails at INIT (its
    /seed_session) as EnvironmentUnreachable, and the row comes back as Gym's failure record
    of kind ``transport_unreachable``, no reward."""
    base, farm, _ = gym_farm
    row = {"responses_create_params": {"input": "[case:hi] count", "tools": [
        {"type": "function", "name": "increment_counter", "parameters": {}}]},
        "prorl": {"resources_server": f"http://127.0.0.1:{free_port()}"}, "expected_count": 1}
    out = requests.post(base + "/run", json=row, timeout=60).json()
    assert out["mask_sample"] is True and "reward" not in out, out
    assert out["failure_kind"] == "transport_unreachable", out
    assert "EnvironmentUnreachable" in out["failure_reason"] and \
        "seed_session" in out["failure_reason"]
    job = farm.job(out["prorl_job_id"])
    assert (job["handler"], job["state"]) == ("gym", "failed")


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
    assert [a.status_code for a in answers] == [200] * 8
    assert all(a.json()["reward"] == 0.5 for a in answers[::2])
    assert all(d["loc"] == ["body", "prorl", "instance", "reward"]
               for a in answers[1::2] for d in a.json()["prorl_refused"])


def test_many_rows_at_once_share_the_servers_batch(gym_farm):
    """128 rows at once: 128 jobs, all in the server's current farm batch (whose one results
    stream every row in flight waits on)."""
    base, farm, _ = gym_farm
    row = {"responses_create_params": {"input": "x"},
           "prorl": {"handler": "synthetic", "instance": {"reward": 1.0}}}
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda _: requests.post(base + "/run", json=row, timeout=120),
                                range(128)))
    assert all(a.status_code == 200 and a.json()["reward"] == 1.0 for a in answers)
    jobs = [farm.job(a.json()["prorl_job_id"]) for a in answers]
    assert len({j["id"] for j in jobs}) == 128
    assert len({j["batch_id"] for j in jobs}) == 1


def test_a_client_that_goes_away_cancels_its_rows_job(gym_farm):
    base, farm, _ = gym_farm

    def cancelled() -> int:
        return sum(b["counts"]["cancelled"] for b in
                   farm._call("GET", "/v1/batches?limit=1000")["batches"])

    before = cancelled()
    row = {"responses_create_params": {"input": "x"},
           "prorl": {"handler": "synthetic", "instance": {"run_s": 60}}}
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(base + "/run", json=row, timeout=2)  # gives up, closes
    wait_until(lambda: cancelled() == before + 1, 30, 0.2, "the row's job cancelled")


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


# -- NeMo Gym's own code ----------------------------------------------------------------


def require_gym() -> str:
    return require_venv(GYM_PYTHON, "NeMo Gym", "gym", "REQUIRE_GYM")


@pytest.fixture(scope="module")
def counter_gym(gym_farm, tmp_path_factory):
    """Gym's own example_session_state_mgmt resources server (tests/gym_side.py counter), and
    a second `prorl-farm gym` whose rows all run on it (``--resources-server``). Yields
    (that Gym server's URL, the resources server's access log)."""
    python = require_gym()
    _, farm, _ = gym_farm
    tmp = tmp_path_factory.mktemp("counter")
    port, gym_port = free_port(), free_port()
    access = tmp / "counter.log"
    procs = []
    with open(access, "ab") as log:
        procs.append(subprocess.Popen([python, GYM_SIDE, "counter", str(port)], cwd=tmp,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "prorl_farm.cli", "gym", "--port", str(gym_port), "--farm",
             farm.base_url, "--resources-server", f"http://127.0.0.1:{port}"], cwd=ROOT,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    base = f"http://127.0.0.1:{gym_port}"
    try:
        wait_until(lambda: _up(base) and _up(f"http://127.0.0.1:{port}", "/docs"), 90, 0.2,
                   "Gym's counter resources server and its Gym server")
        yield base, access
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.fixture(scope="module")
def datasets_port():
    """Where the `prorl-farm gym` of a replayed Gym environment listens (gym_head's
    ``prorl_farm_datasets`` agent)."""
    return free_port()


@pytest.fixture(scope="module")
def gym_head(gym_farm, counter_gym, datasets_port, tmp_path_factory):
    """Gym's head server (its own HeadServer, no Ray) serving a config with the farm behind
    both entries an agent needs: the agent server and its legacy_agent environment server.
    Yields (host, port, config path)."""
    python = require_gym()
    base, _, _ = gym_farm
    farm_port = int(base.rsplit(":", 1)[1])
    tmp = tmp_path_factory.mktemp("gym-head")
    port = free_port()
    config = tmp / "farm.yaml"
    config.write_text(f"""head_server:
  host: 127.0.0.1
  port: {port}
prorl_farm_agent:
  responses_api_agents:
    prorl_farm:
      host: 127.0.0.1
      port: {farm_port}
prorl_farm_environment_server:
  environment_servers:
    legacy_agent:
      host: 127.0.0.1
      port: {farm_port}
      agent_server:
        type: responses_api_agents
        name: prorl_farm_agent
      max_concurrent_episodes: null
      queue_timeout_seconds: null
      default_episode_timeout_seconds: 21600
      cleanup_timeout_seconds: 180
prorl_farm_counter:
  responses_api_agents:
    prorl_farm:
      host: 127.0.0.1
      port: {counter_gym[0].rsplit(":", 1)[1]}
prorl_farm_counter_environment_server:
  environment_servers:
    legacy_agent:
      host: 127.0.0.1
      port: {counter_gym[0].rsplit(":", 1)[1]}
      agent_server:
        type: responses_api_agents
        name: prorl_farm_counter
      max_concurrent_episodes: null
      queue_timeout_seconds: null
      default_episode_timeout_seconds: 21600
      cleanup_timeout_seconds: 180
prorl_farm_datasets:
  responses_api_agents:
    prorl_farm:
      host: 127.0.0.1
      port: {datasets_port}
prorl_farm_datasets_environment_server:
  environment_servers:
    legacy_agent:
      host: 127.0.0.1
      port: {datasets_port}
      agent_server:
        type: responses_api_agents
        name: prorl_farm_datasets
      max_concurrent_episodes: null
      queue_timeout_seconds: null
      default_episode_timeout_seconds: 21600
      cleanup_timeout_seconds: 180
""")
    log = open(tmp / "head.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen([python, GYM_SIDE, "head", f"+config_paths=[{config}]"],
                            cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_until(lambda: _up(f"http://127.0.0.1:{port}"), 60, 0.2, "Gym's head server")
        yield "127.0.0.1", port, config
    finally:
        stop_process(proc)
        log.close()


def _two_task_types(n: int) -> list[dict]:
    """Gym rows of two task types: ``math`` (a python tool call, then the answer; right
    or wrong) and ``chat`` graded by ``contains`` (one turn)."""
    rows = []
    for i in range(n):
        if i % 2 == 0:
            row = math_row("sq" if i % 4 == 0 else "sq-wrong")
        else:
            row = {"responses_create_params": {
                "input": [{"role": "user", "content": "[case:hi] What is the answer?"}],
                "temperature": 1.0, "top_p": 1.0, "max_output_tokens": 32},
                "expected_answer": "42", "prorl_grader": "contains"}
        for key in ("agent_ref", "_ng_task_index", "_ng_rollout_index"):
            row.pop(key, None)
        rows.append(row)
    return rows


def _collect(config: Path, rows: list[dict], tmp_path: Path, parallel: int,
             agent: str = "prorl_farm_agent", failed: int = 0) -> list[dict]:
    """``ng_collect_rollouts`` (Gym's CLI) over ``rows``; its output rows (exit 0), and
    ``failed`` rows in its failures file (rows that produced no rollout)."""
    inp, out = tmp_path / "rows.jsonl", tmp_path / "rollouts.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    collect = Path(require_gym()).parent / "ng_collect_rollouts"
    run = subprocess.run([str(collect), f"+config_paths=[{config}]",
                          f"+agent_name={agent}", f"+input_jsonl_fpath={inp}",
                          f"+output_jsonl_fpath={out}",
                          f"+num_samples_in_parallel={parallel}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == len(rows) - failed
    assert len(_failures(tmp_path)) == failed
    return results


def _failures(tmp_path: Path) -> list[dict]:
    """The rows of the collection's failures file (Gym's sidecar)."""
    side = tmp_path / "rollouts_failures.jsonl"
    return [json.loads(line) for line in side.read_text().splitlines()] if side.exists() \
        else []


def test_ng_collect_rollouts_runs_64_rows_through_the_farm(gym_farm, gym_head, tmp_path):
    """`ng_collect_rollouts` (Gym's CLI) over 64 rows of two task types: exit 0, no
    failures, one output row per input, each valid as Gym's ``BaseVerifyResponse`` (the
    items with ids as its ``*ForTraining`` models), each equal to its farm job."""
    _, farm, _ = gym_farm
    _, _, config = gym_head
    rows = _two_task_types(64)
    results = _collect(config, rows, tmp_path, 32)
    out = tmp_path / "rollouts.jsonl"
    failures = tmp_path / "rollouts_failures.jsonl"
    assert not failures.exists() or not failures.read_text().strip()
    checked = subprocess.run([require_gym(), GYM_SIDE, "validate", str(out)],
                             capture_output=True, text=True, timeout=120, check=True)
    valid = [json.loads(line) for line in checked.stdout.splitlines()]
    assert len(valid) == len(rows)
    for v in valid:
        trained = [c for c in v["items"] if c.endswith("ForTraining")]
        assert trained and v["items"][-1].endswith("ForTraining"), v
    handlers, rewards = set(), []
    for res in results:
        job = _check_against_the_farm(farm, res)
        handlers.add(job["handler"])
        rewards.append(res["reward"])
    assert handlers == {"math", "chat"}
    assert sorted(set(rewards)) == [0.0, 1.0]
    metrics = json.loads((tmp_path / "rollouts_aggregate_metrics.json").read_text())
    assert metrics, "no aggregate metrics written"


def test_ng_collect_rollouts_finishes_the_good_rows_beside_failed_and_refused_ones(
        gym_farm, gym_head, broken_verifier, tmp_path):
    """Through Gym's own collector, rows that succeed beside a row the farm refuses, a row
    whose job fails before its model ran, and a row whose verifier fails after it did: exit
    0 and every good row done; the refused and the failed row in Gym's failures file (no
    reward, the reason), out of the score; the row whose model ran kept masked with its
    tokens, out of the score too (Gym's aggregate counts only unmasked rows)."""
    _, farm, _ = gym_farm
    _, _, config = gym_head
    failing = {"responses_create_params": {"input": "x"},
               "prorl": {"handler": "synthetic", "instance": {"fail_stage": "eval"}}}
    bad = {"responses_create_params": {"input": "x"}, "expected_answer": "B"}
    rows = _two_task_types(4) + [failing, bad, masked_row(broken_verifier)]
    results = _collect(config, rows, tmp_path, 8, failed=2)
    [masked] = [r for r in results if r.get("mask_sample")]
    assert masked["failure_kind"] == "verifier_error" and masked["reward"] == 0.0
    assert sorted(r["reward"] for r in results if not r.get("mask_sample")) == \
        [0.0, 1.0, 1.0, 1.0]
    failures = {"prorl_refused" in f: f for f in _failures(tmp_path)}
    assert failures[True]["prorl_refused"][0]["loc"] == ["body", "prorl_grader"]
    assert failures[True]["_ng_failure_terminal"] is True
    assert failures[False]["failure_kind"] == "verifier_error" and "reward" not in \
        failures[False]
    assert farm.job(failures[False]["prorl_job_id"])["state"] == "failed"
    metrics = json.loads((tmp_path / "rollouts_aggregate_metrics.json").read_text())
    text = json.dumps(metrics)
    assert "0.75" in text, text[:2000]  # 3 of the 4 scored rows: the masked one left out


def test_nemo_rl_call_path_gives_the_verl_adapters_tensors(gym_farm, gym_head,
                                                          broken_verifier, tmp_path):
    """Rows as NeMo RL's ``NemoGym.run_rollouts`` sends them (``agent_ref``, ``_rowidx``)
    through Gym's ``RolloutCollectionHelper.run_examples``, each result taken as NeMo RL
    takes it (tests/gym_side.py): the good rows give the same tokens, loss mask and
    logprobs as the farm's VeRL adapter gives for the same job, up to the last sampled
    token (where NeMo RL's message log ends); a row whose verifier failed after its model
    answered is taken with its tokens and masked out of the loss (``loss_multiplier`` 0);
    a row whose job failed before any generation is NeMo RL's data failure of that prompt
    (retried, then skipped), never a reward."""
    from prorl_farm.trainer.adapters import to_verl

    _, farm, _ = gym_farm
    host, port, _ = gym_head
    good = _two_task_types(8)
    failing = {"responses_create_params": {"input": "x"},
               "prorl": {"handler": "synthetic", "instance": {"fail_stage": "eval"}}}
    rows = good + [masked_row(broken_verifier, 1), failing]
    for i, row in enumerate(rows):
        row["agent_ref"] = {"type": "responses_api_agents", "name": "prorl_farm_agent"}
        row["_rowidx"] = i
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = subprocess.run([require_gym(), GYM_SIDE, "nemo_rl", host, str(port), str(inp)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    laid = sorted((json.loads(line) for line in run.stdout.splitlines()),
                  key=lambda x: x["rowidx"])
    assert [x["rowidx"] for x in laid] == list(range(len(rows)))
    *laid, masked, failed = laid
    assert failed["error"].startswith("ValueError: NeMo Gym returned a result with no "
                                      "generation data"), failed
    assert farm.job(failed["job_id"])["state"] == "failed"
    assert masked["mask_sample"] is True and masked["loss_multiplier"] == 0.0
    job = farm.job(masked["job_id"])
    assert job["state"] == "failed" and masked["token_ids"] == \
        job["result"]["prompt_ids"] + job["result"]["response_ids"]
    jobs = [farm.job(x["job_id"]) for x in laid]
    verl = to_verl([jobs], pad_token_id=0, logprobs_mode=None)["batch"]
    for i, (x, job) in enumerate(zip(laid, jobs)):
        assert x["reward"] == job["reward"] and x["mask_sample"] is False
        assert x["loss_multiplier"] == 1.0
        prompt = job["result"]["prompt_ids"]
        n_resp = len(x["token_ids"]) - len(prompt)
        p_len = verl["prompts"].shape[1]
        attn = verl["attention_mask"][i]
        ids = verl["input_ids"][i][attn == 1].tolist()
        assert x["token_ids"] == ids[:len(x["token_ids"])]
        assert x["token_loss_mask"][len(prompt):] == verl["response_mask"][i][:n_resp].tolist()
        assert x["generation_logprobs"][len(prompt):] == pytest.approx(
            verl["rollout_log_probs"][i][:n_resp].tolist(), abs=0)
        assert not any(x["token_loss_mask"][:len(prompt)])
        assert verl["response_mask"][i][n_resp:].sum() == 0  # nothing sampled after it
        assert attn[:p_len].sum() == len(prompt)


COUNTER_ROWS = (Path(GYM_PYTHON).parent.parent / "lib" / "python3.13" / "site-packages" /
                "resources_servers" / "example_session_state_mgmt" / "data" / "example.jsonl")
COUNTER_ROUTES = {"/seed_session", "/increment_counter", "/get_counter_value", "/verify"}


def _routes(access: Path) -> list[str]:
    """The paths the resources server was asked for (uvicorn's access log), in order."""
    return re.findall(r'"POST (\S+) HTTP', access.read_text())


def test_gyms_own_resources_server_grades_rows_run_on_the_farm(gym_farm, gym_head, counter_gym,
                                                               tmp_path):
    """Gym's example_session_state_mgmt environment (its resources server, its dataset as
    shipped) through ``ng_collect_rollouts`` and the farm: each row a ``gym`` job that seeds
    the server's session (the row's ``initial_count``), calls its tools on that session
    (the counter grows in the server), and takes its reward from the server's ``/verify``
    (the counter against ``expected_count``). The same rows with a wrong ``expected_count``
    earn 0: the reward is the server's verdict on the session's state. Every row is token-
    exact against its farm job, and the tool outputs are the server's own."""
    _, farm, _ = gym_farm
    _, _, config = gym_head
    _, access = counter_gym
    shipped = [json.loads(line) for line in COUNTER_ROWS.read_text().splitlines()]
    wrong = [{**r, "expected_count": r["expected_count"] + 1} for r in shipped]
    before = len(_routes(access))
    results = _collect(config, shipped + wrong, tmp_path, 8, agent="prorl_farm_counter")
    assert sorted(r["reward"] for r in results) == [0.0] * len(wrong) + [1.0] * len(shipped)
    for res in results:  # in the order they ended
        job = _check_against_the_farm(farm, res)
        assert job["handler"] == "gym"
        m = COUNTER.search(res["responses_create_params"]["input"][0]["content"])
        count = res["initial_count"] + int(m[1]) + int(m[2])
        assert res["reward"] == float(res["expected_count"] == count)
        calls = [i for i in res["response"]["output"] if i["type"] == "function_call"]
        outs = [json.loads(i["output"]) for i in res["response"]["output"]
                if i["type"] == "function_call_output"]
        assert [c["name"] for c in calls] == ["increment_counter", "increment_counter",
                                              "get_counter_value"]
        assert outs == [{"success": True}, {"success": True}, {"count": count}]
    routes = _routes(access)[before:]
    assert set(routes) == COUNTER_ROUTES
    assert routes.count("/seed_session") == routes.count("/verify") == len(results)


def test_a_policy_reaches_the_resources_server_only_through_the_rows_tools(
        gym_farm, counter_gym):
    """The policy as an adversary: it calls the server's own routes as tools (``verify``,
    ``seed_session`` to reset its count, ``close_session``, ``aggregate_metrics``) and
    paths that climb out of a tool's (``../verify``, ``increment_counter/../verify``).
    None leaves the farm: each is an unknown tool to the model, the server sees one
    seed_session and one verify per job (the farm's own), and the reward stays 0."""
    base, access = counter_gym
    _, farm, _ = gym_farm
    row = json.loads(COUNTER_ROWS.read_text().splitlines()[0])
    row["responses_create_params"]["input"][0]["content"] += " [case:forge]"
    before = len(_routes(access))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: requests.post(base + "/run", json=row, timeout=120),
                                range(4)))
    for a in answers:
        out = a.json()
        assert a.status_code == 200 and out["reward"] == 0.0 and not out["mask_sample"], out
        job = farm.job(out["prorl_job_id"])
        tool_msgs = [m["content"] for m in job["result"]["messages"] if m["role"] == "tool"]
        assert len(tool_msgs) == 6 and all("unknown tool" in m for m in tool_msgs), tool_msgs
    routes = _routes(access)[before:]
    assert sorted(routes) == sorted(["/seed_session", "/verify"] * 4), routes


def test_rows_in_flight_survive_a_redis_restart_and_an_api_restart(tmp_path):
    """Rows waiting on the Gym server while the farm's Redis restarts (append-only, fsync
    always) and then while its API restarts: every row is answered 200 with its job's own
    reward, none lost, none answered 0 for a failure; rows sent while the API is down are
    refused (502) and enqueue nothing."""
    from prorl_farm.config import load_settings
    from tests.farm import Pools, RedisServer, farm_env, gunicorn_api

    server = RedisServer(tmp_path / "redis", appendonly=True, fsync="always")
    env = farm_env(server.url)
    load_settings(env)
    pools = Pools(env, tmp_path)
    api_port, gym_port = free_port(), free_port()
    url, base = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{gym_port}"
    api = gym = None
    try:
        pools.start()
        api = gunicorn_api(env, api_port, tmp_path / "api.log")
        wait_until(FarmClient(url).ready, 30, 0.2, "the API")
        with open(tmp_path / "gym.log", "ab") as log:
            gym = subprocess.Popen([sys.executable, "-m", "prorl_farm.cli", "gym", "--port",
                                    str(gym_port), "--farm", url], env=env, cwd=ROOT,
                                   stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        wait_until(lambda: _up(base), 30, 0.1, "gym server")

        def row(i: int) -> dict:
            return {"responses_create_params": {"input": "x"}, "prorl": {
                "handler": "synthetic", "instance": {"run_s": 3.0, "reward": i / 100}}}

        def send(i: int):
            return requests.post(base + "/run", json=row(i), timeout=300)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            first = [pool.submit(send, i) for i in range(16)]
            wait_until(lambda: _jobs(FarmClient(url)) == 16, 30, 0.1, "16 jobs in")
            server.restart(down_s=2.0)
            second = [pool.submit(send, i) for i in range(16, 32)]
            wait_until(lambda: _jobs(FarmClient(url)) == 32, 60, 0.2, "32 jobs in")
            stop_process(api)
            refused = send(99)
            assert refused.status_code == 502, refused.text
            api = gunicorn_api(env, api_port, tmp_path / "api.log")
            wait_until(FarmClient(url).ready, 30, 0.2, "the API again")
            answers = [f.result() for f in first + second]
        assert [a.status_code for a in answers] == [200] * 32, [a.text for a in answers]
        farm = FarmClient(url)
        for i, a in enumerate(answers):
            out = a.json()
            assert out["mask_sample"] is False and out["reward"] == i / 100, out
            assert farm.job(out["prorl_job_id"])["reward"] == i / 100
        assert _jobs(farm) == 32  # the refused row enqueued nothing
    finally:
        for proc in (gym, api):
            if proc is not None:
                stop_process(proc)
        pools.stop()
        server.stop()


@pytest.mark.parametrize("env", ["string_match", "example_multi_step"])
def test_gyms_own_environments_grade_the_farms_rows_as_gym_grades_them(
        gym_farm, gym_head, datasets_port, env, tmp_path):
    """Two of the environments nemo-gym ships, as they come (tests/gym_datasets.py): its
    server from Gym's code, its example rows through ``ng_collect_rollouts`` and a `prorl-
    farm gym` that sends the rows of its agent to that server (``--resources-server
    NAME=URL``). The recorded model's answers, replayed through the farm, earn what Gym's
    own server gives the same answers (string_match, no tools: its right answers, "Final
    answer: Saturn" and a last line "Pacific Ocean" among them, earn 1.0; example_multi_step:
    tool calls on the server's session, then the answer); a scripted wrong answer earns
    what Gym gives it. Every row comes back valid as Gym's ``BaseVerifyResponse``."""
    _, farm, policy = gym_farm
    _, _, config = gym_head
    procs = []

    def start_gym(server: str):
        with open(tmp_path / "gym.log", "ab") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "prorl_farm.cli", "gym", "--port", str(datasets_port),
                 "--farm", farm.base_url, "--resources-server",
                 f"prorl_farm_datasets={server}"], cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
        wait_until(lambda: _up(f"http://127.0.0.1:{datasets_port}"), 30, 0.1, "gym server")
        return lambda: stop_process(procs[-1])

    require_gym()
    try:
        got = gym_datasets.run_env(env, policy.replay, start_gym, config, tmp_path,
                                   free_port(), f"http://127.0.0.1:{datasets_port}", limit=6,
                                   agent="prorl_farm_datasets")
    finally:
        policy.replay.cases = []
    assert not got.disagreements and got.rows >= 4, got
    assert got.returned == got.valid == got.rows and got.right == got.wrong == \
        (got.rows, got.rows), got
    if env == "string_match":
        assert got.earned == 1.0 and got.rows == 5, got  # Saturn, Pacific Ocean among them
