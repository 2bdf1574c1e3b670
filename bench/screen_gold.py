"""The screen (``prorl_farm/graders/screen.py``) on SWE-bench gold patches, with their real
base files: how many honest fixes it would zero (the goal: none).

  python bench/screen_gold.py [--rows FILE ...] [--repos DIR ...] [--record]

``--rows``: SWE-bench rows (JSON list or JSON lines, the dataset's own fields); default the
instances shipped in ``examples/swe-bench``. ``--repos``: directories of git bundles
(``OWNER__NAME.bundle``) or clones (``OWNER__NAME``) holding the rows' base commits; default
``examples/swe-bench/repos``. A row whose base commit is in none of them is counted as
``no base`` (never screened against a guess).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
import tempfile
from pathlib import Path

from common import machine, report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from prorl_farm.graders.screen import screen  # noqa: E402
from prorl_farm.swebench import repos  # noqa: E402
from prorl_farm.swebench.tree import patch_paths, reference_tree  # noqa: E402

DATA = ROOT / "examples" / "swe-bench"


def load_rows(path: Path) -> list[dict]:
    text = path.read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=Path, nargs="*", default=[DATA / "instances.jsonl"])
    ap.add_argument("--repos", nargs="*", default=[str(DATA / "repos")])
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    rows = {r["instance_id"]: r for path in args.rows for r in load_rows(path)}
    counts, flagged = collections.Counter(), []
    with tempfile.TemporaryDirectory(prefix="prs-screen-") as cache:
        for row in rows.values():
            git_dir = repos.find_source(row["repo"], args.repos, cache)
            if git_dir is None or not repos.has_commit(git_dir, row["base_commit"]):
                counts["no base"] += 1
                continue
            base = repos.tree(git_dir, row["base_commit"])
            tree = reference_tree(base, row["patch"], patch_paths(row["patch"]))
            if tree is None:
                counts["does not apply"] += 1
                continue
            why = screen(base, tree, skip=patch_paths(row["test_patch"]))
            counts["flagged" if why else "passed"] += 1
            if why:
                flagged.append((row["instance_id"], why))
    screened = counts["passed"] + counts["flagged"]
    lines = [f"### screen_gold — {datetime.date.today()} — {machine()}", "",
             f"{len(rows)} SWE-bench gold patches ({', '.join(p.name for p in args.rows)}), "
             f"screened against their base commits' files: **{counts['flagged']} flagged** "
             f"of {screened}; no base commit at hand: {counts['no base']}; not applying: "
             f"{counts['does not apply']}.", ""]
    lines += [f"- {iid}: {why}" for iid, why in flagged]
    report(lines, args.record)


if __name__ == "__main__":
    main()
