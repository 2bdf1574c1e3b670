"""Weight updates in place, the engine's side: the dev model server offers vLLM's RL routes
(``/pause`` in ``abort`` or ``wait`` mode, ``/resume``, ``/update_weight_version``,
``/weight_info``) and its token-in/token-out ``/inference/v1/generate`` with the weight
version spans that sampled each output token. A pause in ``abort`` mode ends a generation
in flight with the tokens it has (``abort``, labelled with the old version); a request that
arrives while paused waits and is sampled by the new weights, labelled so."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request

import pytest

from tests.farm import serve_model, wait_until


def _post(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _generate(url: str, n: int, out: list) -> None:
    out.append(_post(url + "/inference/v1/generate", {
        "token_ids": [5, 6, 7], "sampling_params": {
            "max_tokens": n, "ignore_eos": True, "temperature": 1.0, "seed": 1,
            "logprobs": 0}})["choices"][0])


def test_the_dev_server_pauses_aborts_and_labels_versions(tiny_model, tmp_path):
    with serve_model(tiny_model, tmp_path / "dev.log") as url:
        assert _post(url + "/update_weight_version", {"new_version": "3"})["success"]
        assert _get(url + "/weight_info") == {"weight_version": "3"}
        whole: list = []
        _generate(url, 5, whole)
        assert whole[0]["weight_versions"] == [{"version": "3", "start": 0, "end": 5}]
        assert [c["token_id"] for c in whole[0]["logprobs"]["content"]] == \
            whole[0]["token_ids"]
        # A long generation, aborted mid-way by a pause: the tokens it has, version 3.
        cut: list = []
        t = threading.Thread(target=_generate, args=(url, 3000, cut))
        t.start()
        wait_until(lambda: _get(url + "/is_paused") == {"is_paused": False}, 5)
        time.sleep(0.5)
        assert _post(url + "/pause?mode=abort") == {"status": "paused"}
        t.join(30)
        (aborted,) = cut
        assert aborted["finish_reason"] == "abort"
        assert 0 < len(aborted["token_ids"]) < 3000
        assert aborted["weight_versions"] == [{"version": "3", "start": 0,
                                               "end": len(aborted["token_ids"])}]
        # While paused a request waits; the new version label samples it after /resume.
        later: list = []
        t = threading.Thread(target=_generate, args=(url, 4, later))
        t.start()
        time.sleep(0.3)
        assert not later and _get(url + "/is_paused") == {"is_paused": True}
        _post(url + "/update_weight_version", {"new_version": "4"})
        assert _post(url + "/resume") == {"status": "resumed"}
        t.join(30)
        assert later[0]["finish_reason"] == "length"
        assert later[0]["weight_versions"] == [{"version": "4", "start": 0, "end": 4}]


def test_weight_labels_the_farm_reads():
    """Labels the farm set: a version, one loaded in place not yet checked, one whose update
    failed (its tokens never kept); any other (vLLM's "default" before any label) says
    nothing, and the version the backend was pinned at applies."""
    import pytest

    from prorl_farm.errors import BackendError
    from prorl_farm.llm.backends.vllm import version_label, versions_of

    assert version_label("8") == (8, True) and version_label("8:unchecked") == (8, False)
    assert version_label("default") is None and version_label(None) is None
    with pytest.raises(BackendError, match="failed-8"):
        version_label("failed-8")
    assert versions_of([{"version": "7", "start": 0, "end": 3},
                        {"version": "8:unchecked", "start": 3, "end": 5}]) == \
        ([(0, 7), (3, 8)], 8)
    assert versions_of([{"version": "default", "start": 0, "end": 3}]) == ([], None)


N = 300  # tokens a turn: long enough that turns are mid-way when the update comes (the
#         update is asked for once 20 are generating, and pauses them within a step)
JOBS = 32  # of which at least 20 are generating when the update comes
# On vLLM's CPU build, unseeded: its sampler failed once with seeded requests ("CPU Generator
# does not use offset", a seeded request's token discarded) on a loaded machine; what is
# checked (each token's logprob under the weights that sampled it) needs no seed. Turns of
# 2,000 tokens: on a loaded machine the 32 turns reach vLLM over several seconds, and 600
# tokens a turn (~2,000 a second in all) let the first end before the twentieth began; at
# 1,000, once under a full suite, every turn ended before the pause reached the engine.
N_VLLM = 2000


@pytest.mark.slow
def test_an_update_in_place_goes_on_with_the_turns_in_flight(
        tiny_model, tmp_path, tmp_path_factory, redis_server):
    """32 jobs mid-turn on the dev server; an update in place returns while they are still
    generating (it does not wait for them); every trajectory holds all its tokens, those
    before its version boundary exact under the old weights and those after under the new
    ones (teacher forcing, within 1e-3), and says where the boundary is."""
    with serve_model(tiny_model, tmp_path / "dev.log") as url:
        _update_in_place_mid_turn(url, tiny_model, tmp_path, tmp_path_factory, redis_server,
                                  lambda: _get(url + "/get_model_info")["running"] >= 20)


@pytest.mark.part("vllm")
def test_an_update_in_place_on_real_vllm(tmp_path, tmp_path_factory, redis_server):
    """The same on vLLM's CPU build, through its own routes (/pause with abort, /resume,
    /update_weight_version; its token route labels every token with its weights' version)."""
    from prorl_farm.dev.tiny import build_tiny_model
    from tests.conftest import start_vllm

    model = build_tiny_model(tmp_path / "model")
    url, stop = start_vllm(model, tmp_path_factory.mktemp("vllm-inplace"), 4096)
    try:
        _update_in_place_mid_turn(url, model, tmp_path, tmp_path_factory, redis_server,
                                  lambda: _running_on_vllm(url) >= 20, N_VLLM, seed=None)
    finally:
        stop()


def _running_on_vllm(url: str) -> float:
    """vLLM's gauge of requests running, from its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _update_in_place_mid_turn(url, model_dir, tmp_path, tmp_path_factory, redis_server,
                              generating, N: int = N, seed: int | None = 3) -> None:  # noqa: N803
    import torch
    from transformers import AutoModelForCausalLM

    from api import create_app
    from prorl_farm.config import load_settings
    from tests.conftest import make_pools
    from tests.farm import farm_env, use_only_backend
    from tests.test_tokens import teacher_forced_logprobs
    from tests.test_weight_sync import _perturbed

    new = _perturbed(model_dir, tmp_path / "new", 0.3, seed=5)
    ids = list(range(3, 30))
    probe = {"token_ids": ids, "logprobs": teacher_forced_logprobs(new, ids)[1:]}
    pools = make_pools(redis_server, tmp_path_factory.mktemp("inplace"), run_concurrency=64)
    pools.start()
    try:
        client = create_app(load_settings(farm_env(redis_server.url))).test_client()
        backend = use_only_backend(client, url=url, kind="vllm", model="tiny",
                                   tokenizer=str(model_dir), capacity=64, policy_version=7)
        sub = client.post("/v1/jobs", json={"handler": "chat", "n": JOBS, "instances": [
            {"messages": [{"role": "user", "content": "Count."}]}],
            "sampling": {"max_tokens": N, "ignore_eos": True,
                         **({"seed": seed} if seed is not None else {})}}).get_json()
        wait_until(generating, 300, 0.02, "20 turns generating")
        t0 = time.monotonic()
        resp = client.post(f"/v1/backends/{backend}/weights", json={
            "path": str(new), "policy_version": 8, "probe": probe, "mode": "in_place"})
        took = time.monotonic() - t0
        assert resp.status_code == 200, resp.get_json()
        batch = client.get(f"/v1/batches/{sub['batch_id']}").get_json()
        assert not batch["complete"], f"the update waited for the batch ({took:.1f} s)"
        assert resp.get_json()["policy_version"] == 8
        wait_until(lambda: client.get(f"/v1/batches/{sub['batch_id']}").get_json()[
            "complete"], 300, 0.2, "the batch")
        jobs = [client.get(f"/v1/jobs/{j}").get_json() for j in sub["job_ids"]]
    finally:
        pools.stop()
    assert [j["state"] for j in jobs] == ["done"] * JOBS, [j["failure"] for j in jobs[:3]]
    old_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    new_model = AutoModelForCausalLM.from_pretrained(str(new), dtype=torch.float32)
    straddled = 0
    for job in jobs:
        t = job["result"]
        assert len(t["response_ids"]) == N and sum(t["response_mask"]) == N  # none lost
        bounds = t["version_boundaries"]
        assert bounds[0] == [0, 7] or bounds == [[0, 8]], bounds
        assert (t["min_version"], t["max_version"]) == (bounds[0][1], bounds[-1][1])
        cut = bounds[1][0] if len(bounds) == 2 else (N if bounds == [[0, 7]] else 0)
        straddled += len(bounds) == 2
        full = t["prompt_ids"] + t["response_ids"]
        n = len(t["prompt_ids"])
        for model, lo, hi in ((old_model, 0, cut), (new_model, cut, N)):
            if hi > lo:
                forced = teacher_forced_logprobs(model, full)[n + lo:n + hi]
                worst = max(abs(a - b) for a, b in zip(forced, t["response_logprobs"][lo:hi]))
                assert worst < 1e-3, (job["id"], lo, hi, worst)
    kinds = sorted(str(j["result"]["version_boundaries"]) for j in jobs)
    assert straddled >= 20, f"only {straddled} of {JOBS} turns were in flight: {kinds}"


# -- faults during an update in place -------------------------------------------------------

M = 240  # tokens a turn in the fault tests: turns in flight when the fault comes (the test
#         acts as soon as 4 are generating)


@contextlib.contextmanager
def _farm(redis_server, tmp_path_factory, tag: str):
    from api import create_app
    from prorl_farm.config import load_settings
    from tests.conftest import make_pools
    from tests.farm import farm_env

    pools = make_pools(redis_server, tmp_path_factory.mktemp(tag), run_concurrency=32)
    pools.start()
    try:
        client = create_app(load_settings(farm_env(redis_server.url))).test_client()
        for b in client.get("/v1/backends").get_json()["backends"]:
            client.delete(f"/v1/backends/{b['id']}")
        yield client
    finally:
        pools.stop()


def _register(client, url, model_dir) -> str:
    resp = client.post("/v1/backends", json={"url": url, "kind": "vllm", "model": "tiny",
                                             "tokenizer": str(model_dir), "capacity": 32,
                                             "policy_version": 7})
    assert resp.status_code == 201, resp.get_json()
    return resp.get_json()["id"]


def _submit(client, n: int) -> dict:
    return client.post("/v1/jobs", json={"handler": "chat", "n": n, "instances": [
        {"messages": [{"role": "user", "content": "Count."}]}],
        "sampling": {"max_tokens": M, "ignore_eos": True, "seed": 3}}).get_json()


def _finished(client, sub: dict, timeout_s: float = 240) -> list[dict]:
    wait_until(lambda: client.get(f"/v1/batches/{sub['batch_id']}").get_json()["complete"],
               timeout_s, 0.2, "the batch (no job hung)")
    return [client.get(f"/v1/jobs/{j}").get_json() for j in sub["job_ids"]]


def _generating(engine: str) -> None:
    """Until the engine generates at least 4 turns at once."""
    wait_until(lambda: _get(engine + "/get_model_info")["running"] >= 4, 300, 0.02,
               f"turns generating on {engine}")


def _update_in_place(client, backend: str, path, probe_dir):
    """Ask for an update in place of ``backend`` to ``path`` at version 8."""
    return client.post(f"/v1/backends/{backend}/weights", json={
        "path": str(path), "policy_version": 8, "probe": _probe(probe_dir),
        "mode": "in_place"})


def _probe(model_dir) -> dict:
    from tests.test_tokens import teacher_forced_logprobs

    ids = list(range(3, 30))
    return {"token_ids": ids, "logprobs": teacher_forced_logprobs(model_dir, ids)[1:]}


@pytest.mark.slow
def test_a_load_that_fails_in_place_moves_the_jobs_to_another_engine(
        tiny_model, tmp_path, tmp_path_factory, redis_server):
    """A's load fails mid-update (no weights at the path): the sync says why (422), A stays
    out with the reason, its jobs go on on B from the tokens they had; nothing A sampled
    after the failure is kept, no job hangs, and every token is still the old weights'."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with serve_model(tiny_model, tmp_path / "a.log") as a, \
            serve_model(tiny_model, tmp_path / "b.log") as b, \
            _farm(redis_server, tmp_path_factory, "inplace-load") as client:
        ba, bb = _register(client, a, tiny_model), _register(client, b, tiny_model)
        sub = _submit(client, 16)
        _generating(a)
        on_a = client.get(f"/v1/backends/{ba}").get_json()["in_flight"]
        pinned_b = client.get(f"/v1/backends/{bb}").get_json()["jobs_total"]
        resp = _update_in_place(client, ba, empty, tiny_model)
        assert resp.status_code == 422, resp.get_json()
        assert "safetensors" in resp.get_json()["error"]["message"]
        jobs = _finished(client, sub)
        back_a = client.get(f"/v1/backends/{ba}").get_json()
        back_b = client.get(f"/v1/backends/{bb}").get_json()
    assert back_a["weights"]["error"].startswith("load_failed") and not back_a["in_heap"]
    assert back_a["in_flight"] == 0 and back_a["policy_version"] == 7
    assert on_a and back_b["jobs_total"] > pinned_b  # A's jobs went on on B
    assert [j["state"] for j in jobs] == ["done"] * 16, [j["failure"] for j in jobs]
    for job in jobs:
        t = job["result"]
        assert len(t["response_ids"]) == M and t["version_boundaries"] == [[0, 7]]
    _teacher_forced(jobs, tiny_model)


def _teacher_forced(jobs: list[dict], model_dir) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_tokens import teacher_forced_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for job in jobs[:4]:
        t = job["result"]
        n = len(t["prompt_ids"])
        forced = teacher_forced_logprobs(model, t["prompt_ids"] + t["response_ids"])[n:]
        worst = max(abs(x - y) for x, y in zip(forced, t["response_logprobs"]))
        assert worst < 1e-3, (job["id"], worst)


@pytest.mark.slow
def test_with_no_engine_left_the_jobs_fail_backend_unavailable_with_the_reason(
        tiny_model, tmp_path, tmp_path_factory, redis_server):
    """The only engine's load fails in place: its jobs fail ``backend_unavailable``, saying
    the update failed (never a reward, never hung)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with serve_model(tiny_model, tmp_path / "a.log") as a, \
            _farm(redis_server, tmp_path_factory, "inplace-alone") as client:
        ba = _register(client, a, tiny_model)
        sub = _submit(client, 8)
        _generating(a)
        resp = _update_in_place(client, ba, empty, tiny_model)
        assert resp.status_code == 422
        jobs = _finished(client, sub, 300)
        assert client.get(f"/v1/backends/{ba}").get_json()["in_flight"] == 0
    states = {j["state"] for j in jobs}
    assert "failed" in states and states <= {"failed", "done"}
    for job in jobs:
        if job["state"] == "failed":
            assert job["reward"] is None and job["failure"]["kind"] == "backend_unavailable"
            message = job["failure"]["message"]
            assert "failed-8" in message or "load_failed" in message, job["failure"]


@pytest.mark.slow
def test_an_engine_that_dies_under_an_update_leaves_its_jobs_on_another(
        tiny_model, tmp_path, tmp_path_factory, redis_server):
    """A dies while its turns are in flight and a trainer updates it in place: the update
    fails with the reason (A unreachable, marked unhealthy), A's jobs go on on B."""
    with serve_model(tiny_model, tmp_path / "a.log") as a, \
            serve_model(tiny_model, tmp_path / "b.log") as b, \
            _farm(redis_server, tmp_path_factory, "inplace-dies") as client:
        ba, _ = _register(client, a, tiny_model), _register(client, b, tiny_model)
        sub = _submit(client, 16)
        _generating(a)
        a.proc.kill()
        resp = _update_in_place(client, ba, tiny_model, tiny_model)
        assert resp.status_code == 422 and "unreachable" in resp.get_json()["error"]["message"]
        jobs = _finished(client, sub)
        back_a = client.get(f"/v1/backends/{ba}").get_json()
    assert not back_a["healthy"] and back_a["in_flight"] == 0
    assert [j["state"] for j in jobs] == ["done"] * 16, [j["failure"] for j in jobs]
    assert all(len(j["result"]["response_ids"]) == M for j in jobs)


@pytest.mark.slow
def test_updates_raced_by_two_trainers_one_refused_a_repeat_idempotent(
        tiny_model, tmp_path, tmp_path_factory, redis_server):
    """Two trainers update one engine in place at once: one is applied, the other refused
    409 ``sync_in_progress``; the same update again is applied again (same version), an
    older version is refused 409 ``policy_version_regressed``."""
    from tests.test_weight_sync import _perturbed

    new = _perturbed(tiny_model, tmp_path / "new", 0.3, seed=5)
    body = {"path": str(new), "policy_version": 8, "probe": _probe(new), "mode": "in_place"}
    with serve_model(tiny_model, tmp_path / "a.log") as a, \
            _farm(redis_server, tmp_path_factory, "inplace-race") as client:
        ba = _register(client, a, tiny_model)
        sub = _submit(client, 8)
        _generating(a)
        app = client.application
        answers: list = []
        gate = threading.Barrier(2)

        def trainer():
            c = app.test_client()
            gate.wait()
            resp = c.post(f"/v1/backends/{ba}/weights", json=body)
            answers.append((resp.status_code, resp.get_json()))

        threads = [threading.Thread(target=trainer) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        codes = sorted(code for code, _ in answers)
        assert codes == [200, 409], answers
        refused = next(doc for code, doc in answers if code == 409)
        assert refused["error"]["code"] == "sync_in_progress"
        again = client.post(f"/v1/backends/{ba}/weights", json=body)
        assert again.status_code == 200 and again.get_json()["policy_version"] == 8
        older = client.post(f"/v1/backends/{ba}/weights", json=dict(body, policy_version=7))
        assert older.status_code == 409
        assert older.get_json()["error"]["code"] == "policy_version_regressed"
        jobs = _finished(client, sub)
    assert [j["state"] for j in jobs] == ["done"] * 8
    assert all(j["result"]["max_version"] <= 8 for j in jobs)
