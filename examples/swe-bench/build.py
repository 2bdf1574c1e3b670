"""Build the real SWE-bench instances the farm ships (``examples/swe-bench``), from public
copies of the datasets and clones of the repositories. Run by whoever refreshes the data,
with the network; nothing at test or job time runs it.

    # 1. the environment specs, from swebench 4.1.0's tables (an unpacked wheel)
    python examples/swe-bench/build.py specs SWEBENCH_4_1_0_DIR
    # 2. the instances and their repositories (shallow git bundles of the commits named)
    python examples/swe-bench/build.py data --rows ROWS.json [ROWS.json ...] \\
        --clone owner/name=PATH [...] --ids ID [ID ...]
    # 3. the locks: each environment resolved once from the registry, then frozen
    python examples/swe-bench/build.py locks

The rows keep SWE-bench's own fields, values untouched (``FAIL_TO_PASS`` and
``PASS_TO_PASS`` as the JSON strings SWE-bench stores); ``SOURCES.md`` says where each
came from. Locks go to ``prorl_farm/swebench/locks``: every later build installs exactly
those versions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

FIELDS = ("repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement",
          "hints_text", "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS",
          "environment_setup_commit")
SPECS = ROOT / "prorl_farm" / "swebench" / "specs.json"
INSTANCES = HERE / "instances.jsonl"


def specs(swebench_dir: str) -> None:
    constants = runpy.run_path(str(Path(swebench_dir) / "swebench" / "harness" / "constants"
                                   / "python.py"))
    table = {repo: {version: spec for version, spec in sorted(versions.items())}
             for repo, versions in sorted(constants["MAP_REPO_VERSION_TO_SPECS_PY"].items())}
    SPECS.write_text(json.dumps({
        "source": "swebench 4.1.0, swebench/harness/constants/python.py",
        "specs": table,
        "requirements_paths": dict(sorted(constants["MAP_REPO_TO_REQS_PATHS"].items()))},
        indent=1, sort_keys=False) + "\n")
    print(f"{SPECS}: {sum(len(v) for v in table.values())} specs of {len(table)} repositories")


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True,
                          text=True).stdout


def data(rows_files: list[str], clones: list[str], ids: list[str]) -> None:
    rows, origin = {}, {}
    for path in rows_files:
        text = Path(path).read_bytes()
        digest = hashlib.sha256(text).hexdigest()
        for row in json.loads(text):
            rows.setdefault(row["instance_id"], row)
            origin.setdefault(row["instance_id"], (Path(path).name, digest))
    clone_of = dict(c.split("=", 1) for c in clones)
    chosen = [{k: rows[i][k] for k in FIELDS} for i in ids]
    by_repo: dict[str, set[str]] = {}
    for row in chosen:
        by_repo.setdefault(row["repo"], set()).update(
            {row["base_commit"], row["environment_setup_commit"]})
    out = HERE / "repos"
    out.mkdir(exist_ok=True)
    for repo, commits in sorted(by_repo.items()):
        source = clone_of[repo]
        _git(source, "config", "uploadpack.allowAnySHA1InWant", "true")
        with tempfile.TemporaryDirectory() as tmp:
            bare = f"{tmp}/r.git"
            subprocess.run(["git", "init", "-q", "--bare", bare], check=True)
            for commit in sorted(commits):
                _git(bare, "fetch", "-q", "--depth", "1", f"file://{source}", commit)
                _git(bare, "update-ref", f"refs/tags/c-{commit}", commit)
            _git(bare, "repack", "-adq", "--depth=250", "--window=250")
            bundle = out / f"{repo.replace('/', '__')}.bundle"
            _git(bare, "bundle", "create", str(bundle), "--all")
        print(f"{bundle.name}: {len(commits)} commits, {bundle.stat().st_size / 1e6:.2f} MB")
    INSTANCES.write_text("".join(json.dumps(row) + "\n" for row in chosen))
    lines = ["| instance | version | from | sha256 of that file |", "|---|---|---|---|"]
    for row in chosen:
        name, digest = origin[row["instance_id"]]
        lines.append(f"| {row['instance_id']} | {row['version']} | {name} | "
                     f"`{digest[:16]}` |")
    print("\n".join(lines))  # the table of SOURCES.md
    print(f"{INSTANCES}: {len(chosen)} instances")


def locks() -> None:
    from prorl_farm.swebench.envs import LOCKS_DIR
    from prorl_farm.swebench.locking import lock_rows

    rows = [json.loads(line) for line in INSTANCES.read_text().splitlines() if line.strip()]
    lock_rows(rows, str(LOCKS_DIR), [str(HERE / "repos")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("specs")
    s.add_argument("swebench_dir")
    d = sub.add_parser("data")
    d.add_argument("--rows", nargs="+", required=True)
    d.add_argument("--clone", nargs="+", required=True, help="owner/name=PATH")
    d.add_argument("--ids", nargs="+", required=True)
    sub.add_parser("locks")
    args = parser.parse_args()
    if args.what == "specs":
        specs(args.swebench_dir)
    elif args.what == "data":
        data(args.rows, args.clone, args.ids)
    else:
        locks()


if __name__ == "__main__":
    main()
