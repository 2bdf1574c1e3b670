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
from tests.test_swebench import ENV_DIR, repo_roots

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def farm_url(redis_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validate")
    build_repos(tmp / "repos")  # the swe sample's repository
    with http_farm(redis_server.url, tmp, "val",
                   sandbox_mount_roots=",".join([str(tmp / "repos"), *repo_roots()]),
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


def test_a_swebench_predictions_file_is_graded_and_reported_as_swebench_reports_it(
        farm_url, tmp_path):
    """``prorl-farm swebench grade`` on a predictions file over the shipped rows: two gold
    patches (a pytest repository's, sympy's: every gold patch also grades in
    tests/test_swebench.py), a wrong patch, two empty ones (``""`` and null), instances
    not predicted, and a row the farm refuses (a version with no environment spec): each
    lands in swebench's own report as swebench's harness would put it, the refusal an error
    with its reason, never an unresolved instance; each instance's log, read by swebench
    5.0.2's ``get_eval_report``, gives the farm's verdict and per-test lists."""
    from tests.test_swebench import _base_file, swebench, wrong_patch

    url, env = farm_url
    shipped = ROOT / "examples" / "swe-bench" / "instances.jsonl"
    rows = [json.loads(line) for line in shipped.read_text().splitlines() if line.strip()]
    by_id = {row["instance_id"]: row for row in rows}
    firsts = [by_id["marshmallow-code__marshmallow-1359"], by_id["sympy__sympy-20590"]]
    others = [by_id[i] for i in ("marshmallow-code__marshmallow-1343", "sqlfluff__sqlfluff-1733",
                                 "sqlfluff__sqlfluff-1517")]
    others += [row for row in rows if row not in firsts and row not in others]
    unknown = {**rows[0], "instance_id": "pytest-dev__pytest-no-spec", "version": "0.0.1"}
    predictions = [{"instance_id": row["instance_id"], "model_name_or_path": "org/model-x",
                    "model_patch": row["patch"]} for row in firsts]
    predictions += [{"instance_id": others[0]["instance_id"], "model_name_or_path": "org/model-x",
                     "model_patch": wrong_patch(others[0], _base_file(others[0]))},
                    {"instance_id": others[1]["instance_id"], "model_name_or_path": "org/model-x",
                     "model_patch": ""},
                    {"instance_id": others[2]["instance_id"], "model_name_or_path": "org/model-x",
                     "model_patch": None},
                    {"instance_id": unknown["instance_id"], "model_name_or_path": "org/model-x",
                     "model_patch": rows[0]["patch"]}]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in [*rows, unknown]))
    path = tmp_path / "preds.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in predictions))
    out = subprocess.run([sys.executable, "-m", "prorl_farm.cli", "swebench", "grade",
                          str(path), "--dataset", str(dataset), "--url", url, "--run-id", "r1",
                          "--report-dir", str(tmp_path / "out"), "--deadline-s", "600"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "out" / "org__model-x.r1.json").read_text())
    ids = lambda group: sorted(r["instance_id"] for r in group)  # noqa: E731
    assert report["resolved_ids"] == ids(firsts), report
    assert report["unresolved_ids"] == ids(others[:1]), report
    assert report["empty_patch_ids"] == ids(others[1:3]), report
    assert report["incomplete_ids"] == ids(others[3:]), report
    assert report["error_ids"] == [unknown["instance_id"]], report
    assert "no SWE-bench environment spec for version '0.0.1'" in \
        report["error_reasons"][unknown["instance_id"]], report
    assert (report["total_instances"], report["submitted_instances"],
            report["completed_instances"], report["schema_version"]) == \
        (len(rows) + 1, len(predictions), len(firsts) + 1, 2), report
    progress = [line for line in out.stderr.splitlines() if line.startswith("[")]
    assert len(progress) == len(firsts) + 1, out.stderr
    # Each completed instance's own report and log, where swebench writes them.
    logs = tmp_path / "out" / "logs" / "run_evaluation" / "r1" / "org__model-x"
    cases, mine = [], []
    for row in [*firsts, others[0]]:
        folder = logs / row["instance_id"]
        ours = json.loads((folder / "report.json").read_text())[row["instance_id"]]
        assert ours["patch_exists"] and ours["patch_successfully_applied"], ours
        assert ours["farm"]["pinned"] is True and ours["farm"]["environment"], ours["farm"]
        cases.append({"instance": row, "log": (folder / "test_output.txt").read_text()})
        mine.append(ours)
    assert not (logs / unknown["instance_id"] / "report.json").exists()
    for ours, theirs in zip(mine, swebench("5.0.2", "report", cases)):
        assert theirs["resolved"] is ours["resolved"], (ours, theirs)
        assert theirs["tests_status"] == {k: ours["tests_status"][k]
                                          for k in ("FAIL_TO_PASS", "PASS_TO_PASS")}


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
