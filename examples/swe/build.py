"""Build the sample repository of ``examples/data/swe.jsonl`` (a git repository, written the
same way every time, so its commit ids are the ones the dataset names).

    python examples/swe/build.py [DEST]     # default: examples/swe/repos

It makes DEST/prorl__calc with two commits on ``main``: the base, where ``mul`` and
``is_even`` are wrong, and a later commit that fixes both (as a real repository's history
holds its fixes; the farm gives an agent only the base tree). Then point the farm at it:
``PRORL_SANDBOX_MOUNT_ROOTS=DEST``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BASE = {
    "calc/__init__.py": '"""Small arithmetic helpers."""\n\n\ndef add(a, b):\n'
                        '    return a + b\n\n\ndef mul(a, b):\n    """a times b, for b >= 0."""\n'
                        '    result = 0\n    for _ in range(b):\n        result += b\n'
                        '    return result\n\n\ndef is_even(n):\n    return n % 2 == 1\n',
    "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n"
                          "    assert add(2, 3) == 5\n",
    "setup.cfg": "[tool:pytest]\ntestpaths = tests\n",
    "README.md": "# calc\n\nSmall arithmetic helpers.\n",
}
# Each instance: its issue, the gold fix and the new test, as edits of the base tree; the
# patches are the `git diff` of those edits.
ISSUES = [
    {"instance_id": "prorl__calc-1",
     "problem_statement": "mul(2, 3) returns 9 instead of 6: multiplication is wrong.",
     "fix": ("calc/__init__.py", "        result += b\n", "        result += a\n"),
     "test": ("mul", "assert mul(2, 3) == 6 and mul(4, 0) == 0")},
    {"instance_id": "prorl__calc-2",
     "problem_statement": "is_even(4) is False and is_even(3) is True: parity is inverted.",
     "fix": ("calc/__init__.py", "return n % 2 == 1\n", "return n % 2 == 0\n"),
     "test": ("is_even", "assert is_even(4) and not is_even(3)")},
]
IDENTITY = {"GIT_AUTHOR_NAME": "prorl", "GIT_AUTHOR_EMAIL": "prorl@example.org",
            "GIT_COMMITTER_NAME": "prorl", "GIT_COMMITTER_EMAIL": "prorl@example.org",
            "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
            "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z", "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_CONFIG_NOSYSTEM": "1"}


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, **IDENTITY}
    return subprocess.run(["git", "-C", str(repo), *args], env=env, check=True, text=True,
                          capture_output=True).stdout


def _edit(repo: Path, rel: str, old: str, new: str) -> str:
    """Apply one edit, return its `git diff`, undo it."""
    path = repo / rel
    text = path.read_text()
    path.write_text(text.replace(old, new, 1))
    patch = _git(repo, "diff")
    path.write_text(text)
    return patch


def build(dest: Path) -> list[dict]:
    """Write DEST/prorl__calc afresh; return the dataset's instances (base_commit set)."""
    repo = Path(dest) / "prorl__calc"
    if repo.exists():
        subprocess.run(["rm", "-rf", str(repo)], check=True)
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    for rel, text in BASE.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "calc: add, mul, is_even")
    base = _git(repo, "rev-parse", "HEAD").strip()
    instances = []
    for issue in ISSUES:
        name, body = issue["test"]
        tests = (repo / "tests/test_calc.py").read_text()
        test_patch = _edit(repo, "tests/test_calc.py", tests,
                           tests.replace("import add\n", f"import add, {name}\n")
                           + f"\n\ndef test_{name}():\n    {body}\n")
        instances.append({
            "instance_id": issue["instance_id"], "repo": "prorl/calc", "base_commit": base,
            "problem_statement": issue["problem_statement"],
            "patch": _edit(repo, *issue["fix"]), "test_patch": test_patch,
            "FAIL_TO_PASS": [f"tests/test_calc.py::test_{name}"],
            "PASS_TO_PASS": ["tests/test_calc.py::test_add"]})
    for issue in ISSUES:  # the later history: the fixes, where `git log` would show them
        rel, old, new = issue["fix"]
        (repo / rel).write_text((repo / rel).read_text().replace(old, new, 1))
    _git(repo, "commit", "-q", "-am", "Fix mul and is_even")
    return instances


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "repos")
    for instance in build(dest):
        print(json.dumps(instance))


if __name__ == "__main__":
    main()
