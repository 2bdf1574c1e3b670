"""Handler plug-ins: registry sources, and how handler errors map to failure kinds."""

from __future__ import annotations

import sys

import pytest

from api import create_app
from prorl_farm.config import load_settings
from prorl_farm.errors import NotFound
from prorl_farm.handlers.registry import HandlerRegistry
from prorl_farm.llm.backends.abstract import SAMPLING_DEFAULTS
from tests.conftest import make_pools
from tests.farm import farm_env, wait_until

PLUGINS = "echo=tests.plugin_handlers:EchoHandler,broken=tests.plugin_handlers:BrokenHandler"


def test_registry_loads_env_plugins_and_skips_broken_ones():
    reg = HandlerRegistry(PLUGINS, use_entry_points=False)
    assert reg.names() == ["arith", "chat", "code", "echo", "gym", "math", "shell", "stem", "swe",
                           "synthetic"]
    with pytest.raises(NotFound):
        reg.get("broken")


def test_registry_loads_entry_points(tmp_path, monkeypatch):
    dist = tmp_path / "farm_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: farm-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[prorl_farm.handlers]\nechoed = tests.plugin_handlers:EchoHandler\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = HandlerRegistry()
    assert "echoed" in reg.names()
    assert reg.get("echoed").name == "echo"
    sys.modules.pop("farm_plugin", None)


@pytest.mark.slow
def test_handler_errors_map_to_failure_kinds(redis_server, tmp_path, r):
    pools = make_pools(redis_server, tmp_path, handlers=PLUGINS)
    pools.start()
    try:
        settings = load_settings(farm_env(redis_server.url, handlers=PLUGINS))
        client = create_app(settings).test_client()
        behaviours = ["ok", "invalid", "no-backend", "bad-reward", "zero"]
        resp = client.post("/v1/jobs", json={
            "handler": "echo", "instances": [{"behaviour": b} for b in behaviours],
            "sampling": {"temperature": 0.7, "max_tokens": 64}})
        assert resp.status_code == 202
        ids = resp.get_json()["job_ids"]
        batch = resp.get_json()["batch_id"]
        wait_until(lambda: client.get(f"/v1/batches/{batch}").get_json()["complete"], 30)
        jobs = {b: client.get(f"/v1/jobs/{i}").get_json() for b, i in zip(behaviours, ids)}
        ok = jobs["ok"]
        assert ok["state"] == "done" and ok["reward"] == 1.0
        assert ok["result"]["echo"] == {"behaviour": "ok"}
        # The request's sampling, every other field stated at the farm's default.
        assert ok["result"]["sampling"] == {**SAMPLING_DEFAULTS, "temperature": 0.7,
                                            "max_tokens": 64}
        # ...recorded with the job, in its document and on a results page alike.
        page = client.get(f"/v1/batches/{batch}/results").get_json()["results"]
        assert {j["id"]: j["sampling"] for j in page}[ids[0]] == ok["result"]["sampling"]
        assert ok["sampling"] == ok["result"]["sampling"]
        assert ok["result"]["eval"] == {"checked": True}
        assert jobs["invalid"]["failure"]["kind"] == "invalid_instance"
        assert jobs["no-backend"]["failure"]["kind"] == "backend_unavailable"
        assert jobs["bad-reward"]["failure"]["kind"] == "eval_error"
        assert "finite number" in jobs["bad-reward"]["failure"]["message"]
        # A real zero reward stays a zero reward, and is not filtered.
        assert jobs["zero"]["state"] == "done" and jobs["zero"]["reward"] == 0.0
        assert not jobs["zero"]["filtered"]
    finally:
        pools.stop()
