"""Repository sources for real SWE instances: git bundles (or git repositories) on the farm's
nodes, never the network.

A bundle shipped as data is usually shallow (only the commits the instances name, without
their parents), which ``git fetch`` refuses to take from a bundle. So a bundle is unpacked
by hand: its pack goes through ``git index-pack`` into a bare repository under the cache
directory, its heads become refs, and its commits are listed in ``shallow``. That is done
once per bundle content (a lock file makes concurrent callers wait, not race).

What an agent gets is a ``.git`` of its own holding **only** the base commit's objects (a
pack made for that commit alone, cached), with ``shallow`` naming the base commit: ``git
log`` shows the original commit id and nothing before or after it, and no object of another
instance's (later) commit is in reach.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import io
import os
import posixpath
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from prorl_farm.errors import InvalidInstance

GIT = ["git", "-c", "core.hooksPath=/dev/null", "-c", "protocol.allow=never"]
BRANCH = "main"


def _git(repo: str | Path, *args: str, data: bytes | None = None, timeout: float = 600
         ) -> bytes:
    out = subprocess.run([*GIT, "-c", f"safe.directory={repo}", "-C", str(repo), *args],
                         input=data, capture_output=True, timeout=timeout,
                         stdin=None if data is not None else subprocess.DEVNULL)
    if out.returncode != 0:
        raise InvalidInstance(f"git {args[0]} failed in {repo}: "
                              f"{out.stderr.decode(errors='replace')[-800:]}")
    return out.stdout


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Locked:
    """An exclusive ``flock`` on ``path`` for a ``with`` block."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _bundle_pack(bundle: str) -> tuple[dict[str, str], bytes]:
    """A v2/v3 bundle's heads ({ref: commit}) and its pack. Prerequisites are refused: the
    repository must stand on its own (shallow is fine)."""
    with open(bundle, "rb") as f:
        data = f.read()
    head, sep, pack = data.partition(b"\n\n")
    lines = head.decode(errors="replace").splitlines()
    if not sep or not lines or lines[0] not in ("# v2 git bundle", "# v3 git bundle"):
        raise InvalidInstance(f"{bundle}: not a git bundle")
    heads = {}
    for line in lines[1:]:
        if line.startswith("@"):
            continue  # v3 capabilities
        if line.startswith("-"):
            raise InvalidInstance(f"{bundle}: a bundle with prerequisites (not self-contained)")
        commit, _, ref = line.partition(" ")
        heads[ref] = commit
    return heads, pack


def unpack_bundle(bundle: str, cache: str) -> str:
    """The bare repository holding ``bundle``'s commits (made once per bundle content)."""
    digest = _digest(bundle)[:16]
    name = Path(bundle).name.removesuffix(".bundle")
    target = Path(cache) / f"{name}-{digest}.git"
    if (target / "prorl-complete").exists():
        return str(target)
    with _Locked(Path(cache) / f".{name}-{digest}.lock"):
        if (target / "prorl-complete").exists():
            return str(target)
        heads, pack = _bundle_pack(bundle)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
        try:
            _git(tmp, "init", "-q", "--bare")
            _git(tmp, "index-pack", "--stdin", "--fix-thin", data=pack)
            for ref, commit in heads.items():
                if ref.startswith("refs/"):
                    _git(tmp, "update-ref", ref, commit)
            commits = sorted(set(heads.values()))
            (tmp / "shallow").write_text("".join(c + "\n" for c in commits))
            (tmp / "prorl-complete").write_text("\n".join(commits) + "\n")
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def sources(repo: str, roots: list[str], cache: str | None = None
            ) -> list[tuple[str, Callable[[], str]]]:
    """Every source of ``owner/name`` under the mount roots, in the roots' order (and, under
    one root: ``owner__name.bundle``, then a git repository at ``owner__name``,
    ``owner/name`` or ``name``): (its path, what opens it as a git directory; a bundle is
    unpacked into ``cache``, and without a cache not looked for)."""
    owner, name = repo.split("/", 1)
    found = []
    for root in roots:
        real_root = os.path.realpath(root)
        for candidate in (f"{owner}__{name}.bundle", f"{owner}__{name}", f"{owner}/{name}",
                          name):
            path = os.path.realpath(os.path.join(root, candidate))
            if not path.startswith(real_root + os.sep):
                continue
            if candidate.endswith(".bundle"):
                if cache is not None and os.path.isfile(path):
                    found.append((path, functools.partial(unpack_bundle, path, cache)))
            elif os.path.isdir(path):
                found.append((path, functools.partial(str, path)))
    return found


def find_source(repo: str, roots: list[str], cache: str | None = None) -> str | None:
    """The git directory of the first of :func:`sources`, or None if there is none."""
    found = sources(repo, roots, cache)
    return found[0][1]() if found else None


def has_commit(git_dir: str, commit: str) -> bool:
    out = subprocess.run([*GIT, "-c", f"safe.directory={git_dir}", "-C", git_dir, "cat-file",
                          "-e", f"{commit}^{{commit}}"], capture_output=True,
                         stdin=subprocess.DEVNULL)
    return out.returncode == 0


def full_commit(git_dir: str, commit: str) -> str:
    return _git(git_dir, "rev-parse", "--verify", f"{commit}^{{commit}}").decode().strip()


@functools.lru_cache(maxsize=32)
def commit_pack(git_dir: str, commit: str) -> tuple[str, bytes, bytes]:
    """(pack name, pack, index) holding ``commit`` and its tree, nothing else."""
    commit = full_commit(git_dir, commit)
    objects = _git(git_dir, "rev-list", "--objects", "--no-walk", commit)
    with tempfile.TemporaryDirectory(prefix="prs-pack-") as tmp:
        name = _git(git_dir, "pack-objects", "-q", f"{tmp}/pack", data=objects).decode().strip()
        pack = Path(f"{tmp}/pack-{name}.pack").read_bytes()
        index = Path(f"{tmp}/pack-{name}.idx").read_bytes()
    return name, pack, index


def workspace_git(git_dir: str, commit: str) -> dict[str, bytes]:
    """The files of a ``.git`` whose only commit is ``commit`` (its original id, shallow),
    checked out on branch ``main``; the index is made inside (``git reset``)."""
    commit = full_commit(git_dir, commit)
    name, pack, index = commit_pack(git_dir, commit)
    return {
        ".git/HEAD": f"ref: refs/heads/{BRANCH}\n".encode(),
        ".git/config": (b"[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n"
                        b"\tbare = false\n\tlogallrefupdates = true\n"),
        f".git/refs/heads/{BRANCH}": f"{commit}\n".encode(),
        ".git/shallow": f"{commit}\n".encode(),
        f".git/objects/pack/pack-{name}.pack": pack,
        f".git/objects/pack/pack-{name}.idx": index,
        ".git/info/exclude": b"",
        ".git/description": b"",
    }


def tar_files(data: bytes | None = None, path: str | None = None) -> dict[str, bytes]:
    """The regular files of a tar (links, devices and unsafe names left out)."""
    files = {}
    with tarfile.open(fileobj=io.BytesIO(data) if data is not None else None, name=path,
                      mode="r:*") as tar:
        for member in tar:
            name = posixpath.normpath(member.name)
            if not member.isreg() or name.startswith(("/", "..")) or name == ".":
                continue
            files[name] = tar.extractfile(member).read()
    return files


@functools.lru_cache(maxsize=8)
def tree(git_dir: str, commit: str) -> dict[str, bytes]:
    """The regular files of ``commit`` (read on this node, never in a sandbox)."""
    try:
        data = _git(git_dir, "archive", "--format=tar", commit)
    except InvalidInstance as e:
        raise InvalidInstance(f"base_commit {commit}: {e}") from e
    return tar_files(data)
