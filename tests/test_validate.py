"""Reference validation: `prorl-farm validate FILE.jsonl --handler H` grades each instance's
own reference (math/stem answer, code canonical solution, swe gold patch) through a
running farm, passes every sample dataset, and names a planted broken instance with the reason."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.farm import ROOT, http_farm
from tests.test_swe import build_repos
from tests.test_swebench import ENV_DIR

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def farm_url(redis_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validate")
    build_repos(tmp / "repos")  # the swe sample's repository
    with http_farm(redis_server.url, tmp, "val",
                   sandbox_mount_roots=f"{tmp / 'repos'},{ROOT / 'examples/swe-bench/repos'}",
                   swe_env_dir=str(ENV_DIR)) as farm:
        yield farm


def _validate(url: str, env: dict, path, handler: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prorl_farm.cli", "validate", str(path),
                           "--handler", handler, "--url", url, "--deadline-s", "120"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("handler", ["math", "stem", "code", "swe"])
def test_every_sample_reference_passes(farm_url, handler):
    url, env = farm_url
    out = _validate(url, env, ROOT / "examples" / "data" / f"{handler}.jsonl", handler)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (ROOT / "examples" / "data" / f"{handler}.jsonl").read_text()
    lines = sum(1 for line in text.splitlines() if line.strip())
    assert f"{lines} of {lines} references pass" in out.stdout


def test_real_swe_instances_validate_one_by_one_with_their_resolve_rate(farm_url, tmp_path):
    """One SWE-bench instance of each repository that examples/swe-bench ships (all of them
    grade by reference in tests/test_swebench.py)."""
    url, env = farm_url
    shipped = ROOT / "examples" / "swe-bench" / "instances.jsonl"
    rows, repos = [], set()
    for line in shipped.read_text().splitlines():
        row = json.loads(line) if line.strip() else None
        if row and row["repo"] not in repos:
            repos.add(row["repo"])
            rows.append(row)
    path = tmp_path / "instances.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = _validate(url, env, path, "swe")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rows)} of {len(rows)} references pass (100%)" in out.stdout
    progress = [line for line in out.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == len(rows), out.stderr
    for row in rows:
        line = next(p for p in progress if f" {row['instance_id']}: ok: reward 1.0 F2P " in p)
        f2p = len(json.loads(row["FAIL_TO_PASS"]) if isinstance(row["FAIL_TO_PASS"], str)
                  else row["FAIL_TO_PASS"])
        assert f"F2P {f2p}/{f2p} " in line and "eval " in line, line


def test_a_planted_broken_reference_is_named(farm_url, tmp_path):
    url, env = farm_url
    text = (ROOT / "examples" / "data" / "code.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rows[2]["canonical_solution"] = "def is_palindrome(s):\n    return True\n"
    del rows[4]["canonical_solution"]
    path = tmp_path / "broken.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _validate(url, env, path, "code")
    assert out.returncode == 1
    assert f"{path}:3: reference earns 0.0" in out.stdout, out.stdout
    assert f"{path}:5: failed: invalid_instance" in out.stdout, out.stdout
    assert f"3 of {len(rows)} references pass" in out.stdout
    math = tmp_path / "math.jsonl"
    math.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n"
                    + json.dumps({"problem": "2+2?", "answer": "\\frac{"}) + "\n")
    out = _validate(url, env, math, "math")
    assert out.returncode == 1 and f"{math}:2:" in out.stdout and f"{math}:1:" not in out.stdout


def test_submit_and_watch_summarise_a_batch(farm_url, tmp_path):
    url, env = farm_url
    data = tmp_path / "synthetic.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (
        {"run_s": 0.05, "reward": 1.0}, {"run_s": 0.05, "reward": 0.0},
        {"fail_stage": "run"})))
    out_path = tmp_path / "out.jsonl"
    out = subprocess.run([sys.executable, "-m", "prorl_farm.cli", "submit", str(data),
                          "--handler", "synthetic", "-n", "3", "--output", str(out_path),
                          "--url", url], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["jobs"] == 9 and summary["states"] == {"done": 6, "failed": 3}
    assert summary["mean_reward"] == 0.5 and summary["failures"] == {"run_error": 3}
    assert summary["pass@1"] == round(1 / 3, 4) and summary["pass@3"] == round(1 / 3, 4)
    written = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert len(written) == 9 and {j["batch_id"] for j in written} == {summary["batch_id"]}
    again = subprocess.run([sys.executable, "-m", "prorl_farm.cli", "watch",
                            summary["batch_id"], "--url", url], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and json.loads(again.stdout) == summary
