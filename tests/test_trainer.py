"""The trainer side against a real farm (pools, gunicorn API, Redis): an idempotent client
that survives lost answers, dynamic sampling with asynchronous replenishment, integer
policy versions through drain/resume, and trajectory export."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from prorl_farm.trainer import FarmClient, FarmConflict, FarmNotFound
from prorl_farm.trainer.dapo import DynamicSampler
from tests.farm import (
    ROOT,
    TcpListener,
    free_port,
    gunicorn_api,
    http_farm,
    stop_process,
    wait_until,
)
from tests.policy_server import PolicyServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def farm(redis_server, tmp_path_factory):
    with http_farm(redis_server.url, tmp_path_factory.mktemp("trainer"), "trainer",
                   run_concurrency=64, init_concurrency=32, eval_concurrency=32,
                   llm_drain_wait_s=4) as farm:
        yield farm


class LossyProxy(TcpListener):
    """Forwards HTTP to the farm, but for the first ``lose`` requests it drops the
    connection after the farm answered: the client never sees the answer."""

    def __init__(self, target_port: int, lose: int):
        self.target_port, self.lose = target_port, lose
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(("127.0.0.1", self.target_port)) as up:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            up.sendall(head.replace(b"keep-alive", b"close") + b"\r\n\r\n" + body)
            answer = b""
            while chunk := up.recv(65536):
                answer += chunk
            if self.lose > 0:
                self.lose -= 1
                return  # the farm did the work; the answer is lost
            conn.sendall(answer)


def test_a_submit_whose_answer_is_lost_is_retried_into_the_same_batch(farm):
    url, _ = farm
    port = int(url.rsplit(":", 1)[1])
    proxy = LossyProxy(port, lose=2)
    try:
        client = FarmClient(f"http://127.0.0.1:{proxy.port}", backoff_s=0.05)
        sub = client.submit("synthetic", [{"reward": 0.5}], n=3)
    finally:
        proxy.close()
    assert sub["replayed"] is True  # the third try found the first one's batch
    direct = FarmClient(url)
    batch = direct.batch(sub["batch_id"])
    assert batch["total"] == 3  # one batch of 3 jobs, not three
    jobs = list(direct.iter_results(sub["batch_id"], timeout_s=60))
    assert sorted(j["id"] for j in jobs) == sorted(sub["job_ids"])
    # Typed errors.
    with pytest.raises(FarmNotFound):
        direct.job("no-such-job")
    with pytest.raises(FarmConflict):
        direct.submit("synthetic", [{"reward": 1.0}], idempotency_key=f"k-{sub['batch_id']}")
        direct.submit("synthetic", [{"reward": 0.0}], idempotency_key=f"k-{sub['batch_id']}")


class CutShort:
    """An API that answers a results page's first request with half its body (the process
    killed mid-answer), then in full; counts the requests."""

    def __init__(self, body: bytes, content_type: str):
        import http.server

        outer = self
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests += 1
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body if outer.requests > 1 else body[:len(body) // 2])
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("binary", [True, False], ids=["arrow", "json"])
def test_a_results_page_cut_short_by_an_api_restart_is_asked_for_again(binary):
    from prorl_farm.columns import ARROW_STREAM, page_bytes

    meta = {"cursor": "1-0", "complete": True, "finished": 1, "total": 1}
    doc = {"id": "j1", "state": "done", "reward": 1.0}
    body = (page_bytes([doc], [None], meta) if binary
            else json.dumps({"results": [doc], **meta}).encode())
    api = CutShort(body, ARROW_STREAM if binary
                   else "application/json")
    try:
        page = FarmClient(api.url, backoff_s=0.01, retries=3).results("b", binary=binary)
    finally:
        api.close()
    assert api.requests == 2 and [j["id"] for j in page["results"]] == ["j1"]


def test_an_api_restart_mid_batch_loses_and_duplicates_nothing(farm, tmp_path):
    """The API process is killed (SIGKILL) while a client streams a batch's results and
    another submits; both carry on once it is back: every job seen once, one batch made."""
    _, env = farm
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    api = gunicorn_api(env, port, tmp_path / "api-1.log")
    wait_until(FarmClient(url).ready, 30, 0.2, "api ready")
    client = FarmClient(url, backoff_s=0.2, retries=10)
    sub = client.submit("synthetic", [{"run_s": 0.4, "rewards": [0.0, 1.0]}], n=60)
    seen, late = [], {}

    def stream():
        seen.extend(j["id"] for j in client.iter_results(sub["batch_id"], wait_s=1.0,
                                                         timeout_s=120))

    def submit_while_down():
        late["sub"] = FarmClient(url, backoff_s=0.2, retries=10).submit(
            "synthetic", [{"reward": 1.0}], n=5)

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: len(seen) > 0 or reader.is_alive(), 10)
    time.sleep(0.5)
    os.killpg(api.pid, signal.SIGKILL)
    api.wait()
    writer = threading.Thread(target=submit_while_down)
    writer.start()
    time.sleep(2.0)  # down for a while: the writer's first tries are refused
    api = gunicorn_api(env, port, tmp_path / "api-2.log")
    try:
        reader.join(timeout=150)
        writer.join(timeout=60)
        assert not reader.is_alive() and not writer.is_alive()
        assert sorted(seen) == sorted(sub["job_ids"])  # each job once, none lost
        assert client.batch(late["sub"]["batch_id"])["total"] == 5  # one submission
    finally:
        stop_process(api)


def test_policy_versions_grow_through_drain_wait_and_resume(farm, tokenizer):
    url, _ = farm
    client = FarmClient(url)
    server = PolicyServer(delay_s=0.2)
    try:
        for b in client.backends():
            client.unregister_backend(b["id"])
        b = client.register_backend(server.url, "vllm", "m", tokenizer, capacity=8,
                                    policy_version=3)["id"]
        sub = client.submit("synthetic", [{"llm_turns": 3}], n=4)
        # every job pinned (one turn at version 3) before the drain; a job that had not
        # reached the backend yet would wait out the drain and run wholly at version 4
        # (test_a_job_that_finds_every_backend_drained_waits_for_the_resume)
        wait_until(lambda: client.backend(b)["in_flight"] == 4, 20, what="jobs pinned")
        client.drain_backend(b)
        assert client.wait_drained(b, timeout_s=60)["in_flight"] == 0
        with pytest.raises(FarmConflict):
            client.resume_backend(b, 2)
        client.resume_backend(b, 4)
        jobs = list(client.iter_results(sub["batch_id"], timeout_s=60))
        assert all(j["state"] == "done" and j["policy_version"] == 3 for j in jobs)
        sub = client.submit("synthetic", [{"llm_turns": 2}], n=2)
        jobs = list(client.iter_results(sub["batch_id"], timeout_s=60))
        assert [j["result"]["policy_versions"] for j in jobs] == [[4, 4], [4, 4]]
        client.unregister_backend(b)
    finally:
        server.kill()


def test_a_job_that_finds_every_backend_drained_waits_for_the_resume(farm, tokenizer):
    """A weight sync (drain, load, resume) is not a failure: jobs that reach RUN while the
    only backend is drained wait for its resume and run at the new version; a cancel still
    ends them at once; a drain longer than PRORL_LLM_DRAIN_WAIT_S (4 s here) fails them
    with the reason, never a reward."""
    url, _ = farm
    client = FarmClient(url)
    server = PolicyServer()
    try:
        for b in client.backends():
            client.unregister_backend(b["id"])
        b = client.register_backend(server.url, "vllm", "m", tokenizer, capacity=8,
                                    policy_version=5)["id"]
        client.drain_backend(b)
        sub = client.submit("synthetic", [{"llm_turns": 2}], n=3)
        time.sleep(1.5)  # every job in RUN, waiting
        assert client.batch(sub["batch_id"])["finished"] == 0
        client.resume_backend(b, 6)
        jobs = list(client.iter_results(sub["batch_id"], timeout_s=60))
        assert [j["state"] for j in jobs] == ["done"] * 3, [j.get("failure") for j in jobs]
        assert all(j["result"]["policy_versions"] == [6, 6] for j in jobs)

        client.drain_backend(b)
        sub = client.submit("synthetic", [{"llm_turns": 1}], n=2)
        time.sleep(1.0)
        t0 = time.monotonic()
        client.cancel_batch(sub["batch_id"])
        jobs = list(client.iter_results(sub["batch_id"], timeout_s=30))
        assert [j["state"] for j in jobs] == ["cancelled"] * 2
        assert time.monotonic() - t0 < 3

        sub = client.submit("synthetic", [{"llm_turns": 1}], n=2)
        jobs = list(client.iter_results(sub["batch_id"], timeout_s=60))
        assert [j["state"] for j in jobs] == ["failed"] * 2
        for j in jobs:
            assert j["reward"] is None and j["failure"]["kind"] == "backend_unavailable"
            assert "stayed drained for 4 s" in j["failure"]["message"], j["failure"]
        assert client.backend(b)["in_flight"] == 0
        client.unregister_backend(b)
    finally:
        server.kill()


def _prompts(count: int):
    """A mix: groups whose rewards agree, groups whose rewards vary, groups with a failed
    rollout; stragglers of different lengths."""
    for i in range(count):
        kind = i % 4
        base = {"run_s": 0.05 + 0.1 * (i % 3), "tag": i}
        if kind == 0:
            yield {**base, "rewards": [1.0]}  # all agree: no signal
        elif kind == 3:
            yield {**base, "rewards": [0.0, 1.0], "fail_stage": "eval", "fail_samples": [0]}
        else:
            yield {**base, "rewards": [0.0, 1.0, 1.0]}


def _synthetic(prompts):
    for p in prompts:
        yield {k: v for k, v in p.items() if k != "tag"}


def test_dynamic_sampling_fills_each_step_with_groups_that_carry_signal(farm):
    url, _ = farm
    client = FarmClient(url)
    sampler = DynamicSampler(client, _synthetic(_prompts(400)), "synthetic", n=4,
                             batch_groups=6, rollout_deadline_s=60, staleness=1)
    seen_batches = []
    try:
        for step in range(3):
            batch = sampler.next_batch(policy_version=step, timeout_s=120)
            stats = batch.stats
            assert len(batch) == 6 and stats.accepted == 6
            for group in batch:
                rewards = group.rewards
                assert len(rewards) == 4 and len(set(rewards)) > 1, rewards
                assert all(j["state"] == "done" for j in group.rollouts)
                assert group.policy_version >= step - 1  # within the staleness bound
                seen_batches.append(group.batch_id)
            assert stats.filtered_zero_variance + stats.filtered_failed > 0 or step > 0
            assert 0 < stats.acceptance_rate < 1
        total = sampler.history
        assert sum(s.filtered_zero_variance for s in total) > 0
        assert sum(s.filtered_failed for s in total) > 0
        assert sum(s.carried_in for s in total[1:]) > 0  # the surplus went to the next step
        # A jump of more than `staleness` versions: what finished is stale and dropped; what
        # is in flight is kept (its rollouts may not have started: they are judged by their
        # oldest token, here the version they were submitted at, having no LLM turn), and
        # dropped as each finishes.
        ready, flying = len(sampler.ready), len(sampler.in_flight)
        batch = sampler.next_batch(policy_version=10, timeout_s=120)
        assert batch.stats.dropped_stale >= ready and batch.stats.carried_in == flying
        assert all(g.submitted_version == 10 and g.policy_version == 10 for g in batch)
        # stale_in_flight="cancel": cancelled at once, by the version they were sent at.
        sampler.stale_in_flight = "cancel"
        before = len(sampler.ready) + len(sampler.in_flight)
        batch = sampler.next_batch(policy_version=20, timeout_s=120)
        assert batch.stats.dropped_stale == before and batch.stats.carried_in == 0
        assert all(g.submitted_version == 20 for g in batch)
        assert batch.stats.staleness_mean is None  # no LLM turn: no token to age
        assert batch.stats.queue_wait_mean_s >= 0 and batch.stats.active_mean_s > 0
    finally:
        sampler.close()
    assert len(set(seen_batches)) == len(seen_batches)  # no group trained on twice
    # Nothing left running on the farm.
    wait_until(lambda: all(client.batch(b)["complete"] for b in sampler.batch_ids), 60,
               what="every group terminal")


def test_without_carry_over_the_surplus_ends_cancelled_in_the_farm(farm):
    url, _ = farm
    client = FarmClient(url)
    prompts = ({"rewards": [0.0, 1.0], "run_s": 0.05 if i < 3 else 5.0} for i in range(40))
    sampler = DynamicSampler(client, prompts, "synthetic", n=2, batch_groups=2, carry=False,
                             prior_acceptance=0.2)
    batch = sampler.next_batch(policy_version=0, timeout_s=60)
    assert len(batch) == 2 and not sampler.in_flight and not sampler.ready
    surplus = [b for b in sampler.batch_ids if b not in {g.batch_id for g in batch}]
    assert surplus and batch.stats.rollouts_wasted >= 2 * (len(surplus) - 1)
    wait_until(lambda: all(client.batch(b)["complete"] for b in surplus), 30,
               what="surplus terminal")
    states = {j["state"] for b in surplus for j in client.iter_results(b, timeout_s=30)}
    assert "cancelled" in states and states <= {"cancelled", "done"}


def test_a_step_submits_at_most_its_group_budget(farm):
    """Once a step has submitted ``max_groups_per_step`` groups, it returns with what
    qualified among them, not with a search for the rest."""
    url, _ = farm
    client = FarmClient(url)
    # Groups 0, 1, 3, 4, 6, 7, ... agree (no signal); groups 2, 5, 8, ... vary.
    prompts = ({"rewards": [0.0, 1.0] if i % 3 == 2 else [1.0]} for i in range(100))
    with DynamicSampler(client, prompts, "synthetic", n=2, batch_groups=4, carry=False,
                        max_groups_per_step=6, prior_acceptance=1.0) as sampler:
        first = sampler.next_batch(policy_version=0, timeout_s=60)
        second = sampler.next_batch(policy_version=1, timeout_s=60)
    for batch in (first, second):
        assert batch.stats.submitted_groups == 6 and len(batch) == 2
        assert batch.stats.filtered_zero_variance == 4
        assert all(sorted(g.rewards) == [0.0, 1.0] for g in batch)
    assert len(sampler.batch_ids) == 12


def test_drop_rollout_keeps_the_rest_of_a_group(farm):
    url, _ = farm
    client = FarmClient(url)
    prompts = [{"rewards": [0.0, 1.0, 1.0, 0.0], "fail_stage": "eval", "fail_samples": [3]}
               for _ in range(4)]
    with DynamicSampler(client, prompts, "synthetic", n=4, batch_groups=2,
                        on_failure="drop_rollout", carry=False) as sampler:
        batch = sampler.next_batch(policy_version=0, timeout_s=60)
    # One failed rollout dropped per group judged (a third may finish in the same poll).
    assert len(batch) == 2 and batch.stats.rollouts_dropped >= 2
    assert all(sorted(g.rewards) == [0.0, 1.0, 1.0] for g in batch)


def test_export_writes_every_trajectory_field(farm, tmp_path):
    url, env = farm
    client = FarmClient(url)
    sub = client.submit("synthetic", [{"rewards": [0.0, 1.0]}, {"fail_stage": "run"}], n=2)
    list(client.iter_results(sub["batch_id"], timeout_s=60))
    out = subprocess.run([sys.executable, "-m", "prorl_farm.cli", "export", sub["batch_id"],
                          "--format", "parquet", "--output", str(tmp_path / "b.parquet"),
                          "--url", url], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "b.parquet").to_pylist()
    assert client.export(sub["batch_id"], str(tmp_path / "b.jsonl")) == 4
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert len(table) == len(rows) == 4
    fields = {"prompt_ids", "response_ids", "response_mask", "response_logprobs", "turns",
              "reward", "state", "failure", "filtered", "timings", "messages",
              "policy_version"}
    assert fields <= set(rows[0]) and fields <= set(table[0])
    failed = [r for r in rows if r["state"] == "failed"]
    assert len(failed) == 2 and all(r["reward"] is None and r["filtered"] for r in failed)
    assert sorted(r["reward"] for r in table if r["state"] == "done") == [0.0, 1.0]
    assert {r["job_id"] for r in table} == set(sub["job_ids"])


def _straggling(count: int, slow: dict, n: int = 4):
    """Groups of ``n`` whose rewards vary, where the samples ``slow`` names ({sample index:
    run_s}) straggle."""
    overrides = [{"run_s": slow[i]} if i in slow else {} for i in range(n)]
    for _ in range(count):
        yield {"rewards": [0.0, 1.0, 1.0, 0.0][:n], "run_s": 0.05,
               "sample_overrides": overrides}


def test_a_group_ends_without_its_straggler_and_the_cut_is_counted(farm):
    """group_min_done=3 of 4: each group ends when three rollouts are done (the fourth runs
    600 s); the straggler is cancelled in the farm, counted as cut, never a reward."""
    url, _ = farm
    client = FarmClient(url)
    with DynamicSampler(client, _straggling(6, {3: 600.0}), "synthetic", n=4,
                        batch_groups=3, carry=False, group_min_done=3,
                        prior_acceptance=1.0) as sampler:
        batch = sampler.next_batch(policy_version=0, timeout_s=120)
        kept = {j["id"] for g in batch for j in g.rollouts}
    s = batch.stats
    assert len(batch) == 3 and s.groups_stopped_early >= 3 and s.rollouts_cut >= 3
    for group in batch:
        assert len(group.rollouts) == 3 and sorted(group.rewards) == [0.0, 1.0, 1.0]
        assert all(j["state"] == "done" for j in group.rollouts)
    wait_until(lambda: all(client.batch(b)["complete"] for b in sampler.batch_ids), 60,
               what="every group terminal")
    cut = [j for b in sampler.batch_ids for j in client.iter_results(b, timeout_s=30)
           if j["sample_index"] == 3]
    assert cut and {j["state"] for j in cut} == {"cancelled"}
    assert all(j["reward"] is None and j["id"] not in kept for j in cut)


def test_a_group_s_rest_carried_trains_later_as_a_group_of_its_own(farm):
    """group_rest="carry": a group ends when two rollouts are done; the two slow ones run on
    and come back in a later step as a group of their own (its own uid), each rollout
    trained once."""
    url, _ = farm
    client = FarmClient(url)
    with DynamicSampler(client, _straggling(2, {2: 2.0, 3: 2.0}), "synthetic", n=4,
                        batch_groups=2, group_min_done=2, group_rest="carry",
                        staleness=2, prior_acceptance=1.0) as sampler:
        first = sampler.next_batch(policy_version=0, timeout_s=60)
        second = sampler.next_batch(policy_version=1, timeout_s=60)
    assert first.stats.groups_stopped_early == 2 and first.stats.rollouts_carried == 4
    assert first.stats.rollouts_cut == 0
    assert all(sorted(g.rewards) == [0.0, 1.0] and g.part == 0 for g in first)
    assert len(second) == 2 and all(g.part == 1 for g in second)
    assert {g.batch_id for g in second} == {g.batch_id for g in first}
    assert {g.uid for g in second}.isdisjoint(g.uid for g in first)
    assert all(sorted(g.rewards) == [0.0, 1.0] for g in second)
    ids = [j["id"] for b in (first, second) for g in b for j in g.rollouts]
    assert len(ids) == len(set(ids)) == 8
    assert sorted(j["sample_index"] for g in second for j in g.rollouts) == [2, 2, 3, 3]


def test_a_step_ends_once_enough_groups_qualify_and_records_the_shortfall(farm):
    """min_groups=2 of 4 with a 1 s grace: two groups are quick, the rest take 600 s; the
    step returns the two, says it is two short, and close() leaves nothing running."""
    url, _ = farm
    client = FarmClient(url)
    quick = _straggling(2, {})
    slow = ({"rewards": [0.0, 1.0], "run_s": 600.0} for _ in range(20))
    prompts = itertools.chain(quick, slow)
    with DynamicSampler(client, prompts, "synthetic", n=4, batch_groups=4, min_groups=2,
                        straggler_grace_s=1.0, prior_acceptance=1.0,
                        max_groups_per_step=6) as sampler:
        batch = sampler.next_batch(policy_version=0, timeout_s=120)
    assert len(batch) == 2 and batch.stats.groups_short == 2
    wait_until(lambda: all(client.batch(b)["complete"] for b in sampler.batch_ids), 60,
               what="every group terminal")


def test_a_farm_that_is_not_ready_is_false_whatever_its_probe_says():
    """/readyz answers 503 with a probe's body (its "error" a string, not an error
    document) while Redis restarts: ready() is False, never an exception."""
    import http.server

    from prorl_farm.dev.devserver import send_body

    class NotReady(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"ready": False, "redis": False,
                               "error": "Error 111 connecting to 127.0.0.1:6379."}).encode()
            send_body(self, 503, body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotReady)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert FarmClient(f"http://127.0.0.1:{server.server_address[1]}").ready() is False
    finally:
        server.shutdown()
        server.server_close()
