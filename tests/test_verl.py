"""The farm's trajectories through VeRL itself (0.9.1, in its own environment, .venv-verl,
as `make verl` installs it): multi-turn chat episodes at temperature 0.7 from a backend that
returns processed logprobs, fetched with FarmClient's Arrow path and laid out by ``to_verl``,
then run through VeRL's reward extraction, GRPO advantages, policy loss and loss
aggregation, with the logprobs recomputed through VeRL's padded layout equal to the
rollout's (tests/verl_checks.py). Skipped where VeRL is not installed; failed instead where
REQUIRE_VERL=1 (as `make test` sets once it installed VeRL).

VeRL is imported once for the module (tests/verl_host.py runs both check scripts), and the
farm (pools, the API under gunicorn, the backend) serves both tests."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.farm import ROOT, http_farm, require_venv, serve_model, wait_until

pytestmark = pytest.mark.slow
VERL_PYTHON = ROOT / ".venv-verl" / "bin" / "python"
STOPS = list(range(300, 500))


def require_verl() -> str:
    return require_venv(VERL_PYTHON, "VeRL", "verl", "REQUIRE_VERL")


@pytest.fixture(scope="module")
def processed_server(tiny_model, tmp_path_factory):
    """The dev model server returning processed logprobs (vLLM's --logprobs-mode flag)."""
    with serve_model(tiny_model, tmp_path_factory.mktemp("verl") / "server.log",
                     "--logprobs-mode", "processed_logprobs") as url:
        yield url


@pytest.fixture(scope="module")
def verl_farm(redis_server, tmp_path_factory, tiny_model, processed_server):
    """Pools, the API under gunicorn and the processed-logprobs backend; yields its URL."""
    import redis

    from prorl_farm.trainer import FarmClient
    from tests.conftest import _clear

    # Backends an earlier module of this worker registered in the shared Redis (its engine
    # gone, another tokenizer): a job pinned to one would fail over to ours and be refused.
    left = redis.Redis.from_url(redis_server.url, decode_responses=True)
    _clear(left)
    left.close()
    with http_farm(redis_server.url, tmp_path_factory.mktemp("verl-farm"), "verl") as (url, _):
        farm = FarmClient(url)
        try:
            farm.register_backend(processed_server, "vllm", "tiny", str(tiny_model),
                                  capacity=8, logprobs_mode="processed_logprobs")
        finally:
            farm.http.close()
        yield url


class VerlHost:
    """tests/verl_host.py under VeRL's interpreter: VeRL imported once, then each check
    script run in it on request."""

    def __init__(self, python: str, log_path):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
        env["PYTHONPATH"] = str(ROOT)
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen([python, str(ROOT / "tests" / "verl_host.py")], env=env,
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self._answer(600)  # ready

    def _answer(self, timeout_s: float) -> dict:
        import selectors

        end = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = end - time.monotonic()
                assert left > 0 and sel.select(left), f"VeRL host: no answer in {timeout_s} s"
                line = self.proc.stdout.readline()
                assert line, f"VeRL host exited: {Path(self.log_path).read_text()[-6000:]}"
                if line.startswith("RESULT "):
                    return json.loads(line[len("RESULT "):])

    def run(self, script: str, *args: str) -> dict:
        """Run a check script; its last line of output, parsed."""
        self.proc.stdin.write(json.dumps([str(ROOT / "tests" / script), *args]) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(600)
        assert answer["rc"] == 0, (answer["out"][-3000:]
                                   + Path(self.log_path).read_text()[-6000:])
        figures = json.loads(answer["out"].strip().splitlines()[-1])
        print(script, figures)
        return figures

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


@pytest.fixture(scope="module")
def verl_host(tmp_path_factory):
    host = VerlHost(require_verl(), tmp_path_factory.mktemp("verl-host") / "host.log")
    yield host
    host.close()


def test_farm_batches_run_through_verls_trainer_side_at_temperature_0_7(
        verl_farm, verl_host, tiny_model):
    from prorl_farm.trainer import FarmClient

    farm = FarmClient(verl_farm)
    try:
        batches = []
        for i in range(2):  # two prompt groups of four samples each
            instance = {"messages": [{"role": "user", "content": f"def f{i}(x):"}],
                        "observations": ["Traceback: NameError", "ok, again"],
                        "observation_role": "tool", "continue_on_length": True}
            sub = farm.submit("chat", [instance], n=4, sampling={
                "temperature": 0.7, "max_tokens": 12, "seed": 5 + i, "stop_token_ids": STOPS})
            batches.append(sub["batch_id"])
        for b in batches:
            wait_until(lambda b=b: farm.batch(b)["complete"], 180, 0.2, "chat batch")
            assert farm.batch(b)["counts"]["done"] == 4, farm.batch(b)
    finally:
        farm.http.close()
    figures = verl_host.run("verl_checks.py", verl_farm, str(tiny_model), *batches)
    assert figures["rows"] == 8 and figures["temperature"] == 0.7
    assert figures["max_logprob_error"] < 1e-4
    assert max(figures["num_turns"]) > 2  # multi-turn episodes: tool observations between


def test_the_farm_agent_loop_under_verls_agent_loop_worker(verl_farm, verl_host, tiny_model,
                                                           tmp_path):
    figures = verl_host.run("verl_agent_loop_check.py", verl_farm, str(tiny_model),
                            str(tmp_path))
    assert figures["rows"] == 4 and max(figures["num_turns"]) > 2
    assert figures["failed_kind"] == "run_error" and figures["cancelled"] >= 1
