"""A repository of release trees: SWE-bench instances graded on the tree of a release just
before their fix, where the repository itself is out of reach (Django's is 637 MB).

A release's sdist on the package index carries the source with its tests. Each tree listed
in a manifest (``examples/swe-bench/sdists.json``: the release, its sdist's URL and SHA-256)
is downloaded, checked against its digest, and committed into one bare git repository with
fixed author, committer and dates, so the commit id is a function of the tree alone: the
rows name that id as their ``base_commit`` (and ``environment_setup_commit``), and the build
checks that it comes out the same. The original commit ids stay in the manifest. Built once
into a cache directory (a lock makes concurrent builders wait).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from prorl_farm.swebench.repos import _Locked

IDENTITY = {"GIT_AUTHOR_NAME": "sdist", "GIT_AUTHOR_EMAIL": "sdist@pypi.org",
            "GIT_COMMITTER_NAME": "sdist", "GIT_COMMITTER_EMAIL": "sdist@pypi.org",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
            "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000"}


def _git(git_dir: str, *args: str, work_tree: str | None = None, index: str | None = None
         ) -> str:
    argv = ["git", "-c", f"safe.directory={git_dir}", "-c", "core.autocrlf=false",
            "--git-dir", git_dir]
    if work_tree:
        argv += ["-c", f"safe.directory={work_tree}", "--work-tree", work_tree]
    env = {**os.environ, **IDENTITY, "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"}
    if index:
        env["GIT_INDEX_FILE"] = index
    out = subprocess.run([*argv, *args], capture_output=True, env=env,
                         stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(f"git {args[0]}: {out.stderr.decode(errors='replace')[-500:]}")
    return out.stdout.decode().strip()


def fetch(url: str, sha256: str, cache: Path) -> bytes:
    """The sdist at ``url``, from ``cache`` or the index, checked against ``sha256``."""
    path = cache / f"{sha256}.tar.gz"
    if path.exists():
        data = path.read_bytes()
    else:
        with urllib.request.urlopen(url, timeout=300) as answer:  # noqa: S310 - https only
            data = answer.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise RuntimeError(f"{url}: its SHA-256 is not {sha256}")
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return data


def commit_tree(git_dir: str, data: bytes, message: str) -> str:
    """Commit the tree of an sdist (its top directory stripped; regular files, modes kept
    as executable or not) in ``git_dir``; the commit's id."""
    with tempfile.TemporaryDirectory(prefix="prs-sdist-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                parts = member.name.split("/", 1)
                if len(parts) < 2 or not member.isreg() or ".." in parts[1].split("/"):
                    continue
                target = os.path.join(tmp, parts[1])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(tar.extractfile(member).read())
                os.chmod(target, 0o755 if member.mode & 0o111 else 0o644)
        index = tmp + ".index"
        try:
            _git(git_dir, "add", "-A", "-f", ".", work_tree=tmp, index=index)
            tree = _git(git_dir, "write-tree", work_tree=tmp, index=index)
        finally:
            if os.path.exists(index):
                os.unlink(index)
    return _git(git_dir, "commit-tree", tree, "-m", message)


def build(manifest: dict, target: str, cache: str) -> str:
    """The bare repository ``target`` holding every tree of ``manifest`` (``{"repo":
    "owner/name", "trees": [{"release", "url", "sha256", "commit"}]}``), built once; each
    commit checked against the manifest's id. Returns ``target``."""
    done = Path(target) / "prorl-complete"
    if done.exists():
        return target
    with _Locked(Path(f"{target}.lock")):
        if done.exists():
            return target
        tmp = tempfile.mkdtemp(prefix=".sdists-", dir=os.path.dirname(target) or ".")
        try:
            _git(tmp, "init", "-q", "--bare")
            for tree in manifest["trees"]:
                data = fetch(tree["url"], tree["sha256"], Path(cache))
                commit = commit_tree(tmp, data, f"{manifest['repo']} {tree['release']}, "
                                                f"as its sdist on the package index")
                if commit != tree["commit"]:
                    raise RuntimeError(f"{tree['release']}: the tree committed as {commit}, "
                                       f"not {tree['commit']}")
                _git(tmp, "update-ref", f"refs/tags/{tree['release']}", commit)
            Path(tmp, "prorl-complete").write_text(json.dumps(manifest["trees"]))
            if os.path.exists(target):
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
