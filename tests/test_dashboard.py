"""The dashboard at GET /, looked at in headless Chromium against a real farm: batches with
progress, reward and failures; queues, backends, sandboxes; a job page with its
conversation and tool calls. Screenshots of each page are taken (and kept when
PRORL_SCREENSHOT_DIR names a directory)."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest

from prorl_farm.llm.registry import BackendRegistry
from prorl_farm.trainer import FarmClient
from tests.farm import chromium_dom, chromium_screenshot, http_farm, wait_until
from tests.policy_server import PolicyServer, text_planner
from tests.policy_server import tool_call as call

pytestmark = pytest.mark.slow


PLANS = {"good": [call("python", code="print(6 * 7)"), "So the answer is \\boxed{42}."],
         "wrong": ["It is \\boxed{41}."]}
# Written by the "policy" side: must show as text, never become markup.
HOSTILE = '<img id="pwned" src="x" onerror="document.title=1">'


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _keep(shot: Path) -> None:
    out = os.environ.get("PRORL_SCREENSHOT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(out) / shot.name)


def test_dashboard_pages_in_chromium(redis_server, r, tmp_path, tiny_model):
    server = PolicyServer(planner=text_planner(str(tiny_model), PLANS))
    try:
        with http_farm(redis_server.url, tmp_path, "dash", run_concurrency=8) as (url, _):
            farm = FarmClient(url)
            backend = farm.register_backend(server.url, "vllm", "tiny", str(tiny_model),
                                            capacity=8, policy_version=5)["id"]
            # A second backend whose weights failed their check after a sync: shown so.
            bad = farm.register_backend(server.url, "vllm", "tiny", str(tiny_model))["id"]
            BackendRegistry(r).set_fields(bad, weights_max_error="0.94", weights_error=(
                "weights_mismatch: logprob error 0.94 at probe token 3 exceeds 0.01"))
            agent = farm.submit("math", [
                {"problem": f"[case:good] {HOSTILE} What is 6 times 7?", "answer": "42"},
                {"problem": "[case:wrong] What is 6 times 7?", "answer": "42"}])
            mixed = farm.submit("synthetic", [{"reward": 1.0}, {"reward": 0.0},
                                              {"fail_stage": "eval"}], n=2)
            slow = farm.submit("synthetic", [{"run_s": 30}], n=2)  # in flight while we look
            for sub in (agent, mixed):
                list(farm.iter_results(sub["batch_id"], timeout_s=90))
            wait_until(lambda: farm.batch(slow["batch_id"])["counts"]["run"] == 2, 30)
            good_job = agent["job_ids"][0]
            assert farm.job(good_job)["reward"] == 1.0

            home = chromium_dom(url + "/", tmp_path / "profile")
            for text in (agent["batch_id"], mixed["batch_id"], slow["batch_id"], "complete",
                         backend, "healthy", "run.testnode", "eval_error", "testnode",
                         "Queues and stages", "Nodes", bad, "weights_mismatch (0.940)"):
                assert text in home, f"{text!r} missing from the dashboard"
            assert "node(s)" in home and "updated" in home  # the script ran and drew

            batch = chromium_dom(f"{url}/#batch={mixed['batch_id']}", tmp_path / "profile")
            assert "mean 0.500 over 4 finished job(s)" in batch, batch[-3000:]
            assert "eval_error (failed): 2" in batch
            assert "synthetic failure in eval" in batch  # an example message

            job = chromium_dom(f"{url}/#job={good_job}", tmp_path / "profile")
            assert "print(6 * 7)" in job and "\\boxed{42}" in job
            assert 'class="call"' in job  # the tool call stands out
            assert 'class="msg tool"' in job and "42" in job  # its observation
            assert "Timings" in job and "queue wait" in job
            # The policy-side text is shown as text: no element was made from it.
            assert "&lt;img id=\"pwned\"" in job and '<img id="pwned"' not in job

            for name, page in (("home", "/"), ("batch", f"/#batch={mixed['batch_id']}"),
                               ("job", f"/#job={good_job}")):
                shot = chromium_screenshot(url + page, tmp_path / "profile",
                                           tmp_path / f"dashboard-{name}.png")
                width, height = _png_size(shot)
                assert (width, height) == (1400, 1100) and shot.stat().st_size > 20_000
                _keep(shot)
            farm.cancel_batch(slow["batch_id"])
    finally:
        server.kill()


def test_dashboard_asks_for_the_token_when_reads_need_it(redis_server, r, tmp_path):
    with http_farm(redis_server.url, tmp_path, "dash-auth", api_token="t0k") as (url, _):
        dom = chromium_dom(url + "/", tmp_path / "profile")
        assert 'id="auth" style="display: block;"' in dom
        assert "the API token is needed" in dom


def test_the_farm_over_time_survives_an_api_restart_and_is_drawn(redis_server, r, tmp_path,
                                                                 tokenizer):
    """GET /v1/history: jobs ended per minute by state, failures by kind, mean reward and
    pass rate, stage waits, backend load and latency; kept in Redis, so a restarted API
    reads the same; drawn on the dashboard's home page in SVG (no library, no network)."""
    from tests.farm import free_port, gunicorn_api, stop_process

    server = PolicyServer()
    try:
        with http_farm(redis_server.url, tmp_path, "dash-hist", run_concurrency=8) as (url,
                                                                                      env):
            farm = FarmClient(url)
            backend = farm.register_backend(server.url, "vllm", "m", tokenizer, capacity=8)["id"]
            subs = [farm.submit("synthetic", [{"rewards": [1.0, 0.0, 0.5, 1.0]}], n=4),
                    farm.submit("synthetic", [{"fail_stage": "eval"}], n=2),
                    farm.submit("synthetic", [{"llm_turns": 2, "reward": 0.25}], n=3)]
            for sub in subs:
                list(farm.iter_results(sub["batch_id"], timeout_s=90))

            def read(base: str) -> dict:
                return FarmClient(base).history(window_s=900)

            # The reaper's leader samples the backends and the stage waits every 10 s.
            wait_until(lambda: backend in (h := read(url))["backends"]
                       and any(w is not None for w in h["wait_s"]["run"]), 30, 0.5,
                       "a sample of the backends and of the waits")
            h = read(url)
            assert h["step_s"] == 60 and len(h["minutes"]) == 15
            assert h["minutes"] == sorted(h["minutes"])
            assert sum(h["ended"]["done"]) == 7 and sum(h["ended"]["failed"]) == 2
            assert sum(h["failures"]["eval_error"]) == 2
            n = sum(h["rewards"])
            assert n == 7
            assert sum(h["reward_sum"]) == pytest.approx(1.0 + 0.0 + 0.5 + 1.0 + 3 * 0.25)
            assert sum(h["passes"]) == 2
            for mean, total, k in zip(h["reward_mean"], h["reward_sum"], h["rewards"]):
                assert mean == (round(total / k, 4) if k else None)
            assert any(w is not None for w in h["wait_s"]["run"])
            assert set(h["backends"][backend]) == {"in_flight", "capacity", "latency_ms"}
            assert 8 in h["backends"][backend]["capacity"]
            # A bad window: a field-level 400.
            bad = farm.http.get(url + "/v1/history", params={"window_s": 5})
            assert bad.status_code == 400 and "window_s" in bad.text

            # Another API process (a restart): the same history, read from Redis.
            port = free_port()
            api = gunicorn_api(env, port, tmp_path / "api2.log")
            try:
                other = f"http://127.0.0.1:{port}"
                wait_until(FarmClient(other).ready, 30, 0.2, "the second API")
                again = read(other)
            finally:
                stop_process(api)
            for doc in (h, again):  # totals (a minute may have turned in between)
                doc["totals"] = ({k: sum(v) for k, v in doc["ended"].items()},
                                 {k: sum(v) for k, v in doc["failures"].items()},
                                 sum(doc["rewards"]), sum(doc["reward_sum"]),
                                 sum(doc["passes"]))
            assert again["totals"] == h["totals"]

            dom = chromium_dom(url + "/", tmp_path / "profile")
            assert "Over time (a point per minute)" in dom
            for chart in ("Rollouts ended per minute, by state",
                          "Mean reward and pass rate (reward ≥ 1) per minute",
                          "Failures per minute, by kind", "Queue wait per stage (mean, s)",
                          "Backend load: jobs in flight (mean)",
                          "Backend latency per request (ms)"):
                assert f'data-chart="{chart}"' in dom, chart
            for series in ("done", "failed", "eval_error", "mean reward", "pass rate", "run",
                           backend):
                assert f'data-series="{series}"' in dom, series
            # ?window= picks the window (a link to share); the picked one is marked.
            short = chromium_dom(url + "/?window=900", tmp_path / "profile")
            assert '<a href="#" class="on">15 min</a>' in short
            assert "<circle" in short  # a short window marks each point
            shot = chromium_screenshot(url + "/", tmp_path / "profile",
                                       tmp_path / "dashboard-history.png")
            assert _png_size(shot) == (1400, 1100)
            _keep(shot)
    finally:
        server.kill()
