"""The file-tree rules of the swe path: the repository's tree at the base commit, the
paths a patch touches, the files a candidate's change never reaches the graded tree
through (test files, test configuration, site hooks, bytecode), the tree EVAL grades, native
code in a repository that builds none, the screen's verdict before any test runs, and the
diff a result keeps. Everything here reads trees as {path: bytes} on the host side, never
in a sandbox."""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import posixpath
import re
import subprocess
import tempfile

from prorl_farm.errors import InvalidInstance, SandboxError
from prorl_farm.graders.screen import screen
from prorl_farm.sandbox.manager import under_mount_roots
from prorl_farm.swebench import repos

# Files the agent's changes never reach the graded tree through (restored from the base).
# Test configuration (what pytest 8 and 9 read; the grader adds what the grading pytest's
# own source names), site hooks.
PROTECTED_NAMES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml",
                             ".pytest.toml", "tox.ini", "setup.cfg", "pyproject.toml",
                             "sitecustomize.py", "usercustomize.py"})
PROTECTED_SUFFIXES = (".pth", ".pyc", ".pyo")
SKIP_DIRS = (".git", "__pycache__")
# Native code: sources a build compiles, and object code (docs/security.md, "No native code
# of the candidate's"). A repository whose base holds none of these builds no native code:
# its tree is mounted noexec when its tests run, and a change that adds any is refused.
NATIVE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".c++", ".m", ".mm", ".pyx", ".pxd", ".pxi",
                   ".f", ".f90", ".f95", ".for", ".rs", ".go", ".s", ".S", ".asm", ".cu",
                   ".so", ".o", ".a", ".pyd", ".dylib", ".dll")
OBJECT_MAGIC = (b"\x7fELF", b"MZ", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"!<arch>\n")

# -- the base tree ----------------------------------------------------------------------


_git_tree = repos.tree


@functools.lru_cache(maxsize=4)
def _archive_tree(path: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    return repos.tar_files(path=path)


def base_tree(inst: dict, roots: list[str]) -> dict[str, bytes]:
    """The repository's files at ``base_commit`` (read on this node, never in a sandbox)."""
    try:
        if inst.get("archive"):
            path = under_mount_roots(inst["archive"], roots, "archive")
            st = os.stat(path)
            return _archive_tree(path, st.st_mtime_ns, st.st_size)
        if inst.get("repo_path"):
            return _git_tree(under_mount_roots(inst["repo_path"], roots, "repo_path"),
                             inst["base_commit"])
    except SandboxError as e:
        raise InvalidInstance(str(e)) from e
    found = repos.sources(inst["repo"], roots)
    for _, opened in found:  # the first, in the roots' order, that holds the base commit
        if repos.has_commit(opened(), inst["base_commit"]):
            return _git_tree(opened(), inst["base_commit"])
    raise InvalidInstance(f"repository {inst['repo']} not found under the mount roots "
                          f"({', '.join(roots) or 'none set: PRORL_SANDBOX_MOUNT_ROOTS'})"
                          + (f" with base_commit {inst['base_commit']}: searched "
                             f"{', '.join(w for w, _ in found)}" if found else ""))


# -- what is graded ---------------------------------------------------------------------

_PATCH_PATH = re.compile(r"^(?:diff --git a/(\S+) b/(\S+)|[-+]{3} [ab]/(\S+))", re.MULTILINE)


def patch_paths(patch: str) -> set[str]:
    """Every path a patch touches, as ``git apply -p1`` (the grader's) reads it: git's own
    parse, whatever the prefixes (``x/``, ``y/``) or quoting of the names, renames' both
    sides. A patch git cannot parse does not apply; its paths are then the headers'."""
    out = subprocess.run(["git", "apply", "--numstat", "-z", "-p1", "-"],
                         input=patch.encode(), capture_output=True)
    if out.returncode != 0:
        return {posixpath.normpath(p) for m in _PATCH_PATH.finditer(patch)
                for p in m.groups() if p}
    paths, fields_ = set(), out.stdout.decode("utf-8", "surrogateescape").split("\0")
    i = 0
    while i < len(fields_):
        entry = fields_[i]
        if not entry:
            i += 1
            continue
        path = entry.split("\t", 2)[2] if entry.count("\t") >= 2 else ""
        if path:
            paths.add(path)
            i += 1
        else:  # a rename or copy: its two names follow
            paths.update(p for p in fields_[i + 1:i + 3] if p)
            i += 3
    return {posixpath.normpath(p) for p in paths}


def trusted_code(base: dict[str, bytes]) -> dict[str, str]:
    """The repository's own Python at the base, by content (path -> SHA-256): the only
    repository code the test run trusts is a file whose content is one of these, at its
    path (a file setup writes, or one the candidate changed, is the candidate's)."""
    return {p: hashlib.sha256(d).hexdigest() for p, d in base.items() if p.endswith(".py")}


def builds_native(base: dict[str, bytes]) -> bool:
    """Whether the base holds native code: sources a build compiles, or object code."""
    return any(p.endswith(NATIVE_SUFFIXES) or data.startswith(OBJECT_MAGIC)
               for p, data in base.items())


def native_change(base: dict[str, bytes], tree: dict[str, bytes], paths) -> str | None:
    """Why the change refuses to be graded in a repository that builds no native code: a
    path of ``paths`` whose content in ``tree`` differs from the base and is native code
    (by its name or its first bytes); None if there is none."""
    for path in sorted(paths):
        data = tree.get(path)
        if data is None or data == base.get(path):
            continue
        if path.endswith(NATIVE_SUFFIXES) or data.startswith(OBJECT_MAGIC):
            return (f"the change adds native code ({path}) to a repository that builds "
                    f"none: its tree is noexec when the tests run, and such a change is "
                    f"refused")
    return None


def is_protected(path: str, test_files: set[str]) -> bool:
    name = posixpath.basename(path)
    return (path in test_files or name in PROTECTED_NAMES or name.endswith(PROTECTED_SUFFIXES)
            or any(part in SKIP_DIRS for part in path.split("/")))


def protected_base(base: dict[str, bytes], test_files: set[str]) -> dict[str, str]:
    """The protected files at the base, for the grader to put back after the instance's
    setup commands (which run the candidate's code): path -> content as latin-1 text."""
    return {p: d.decode("latin-1") for p, d in base.items() if is_protected(p, test_files)}


def graded_tree(base: dict[str, bytes], agent: dict[str, bytes], test_files: set[str],
                also: frozenset[str] = frozenset()) -> tuple[dict[str, bytes], list[str]]:
    """The agent's tree with every protected file (and each of ``also``) as it was at the
    base commit; and the protected paths whose changes were discarded."""
    tree = dict(agent)
    discarded = []
    for path in set(base) | set(agent):
        if is_protected(path, test_files) or path in also:
            if agent.get(path) != base.get(path):
                discarded.append(path)
            if path in base:
                tree[path] = base[path]
            else:
                tree.pop(path, None)
    return tree, sorted(discarded)


def patched(base: dict[str, bytes], patch: str, touched: set[str]) -> dict[str, bytes] | None:
    """The files ``patch`` touches (``touched``: its :func:`patch_paths`), as ``git apply``
    leaves them over ``base`` (in a directory of its own; None if it does not apply): a
    reference patch, for the screen."""
    with tempfile.TemporaryDirectory(prefix="prorl-screen-") as d:
        for path in touched:
            if path in base:
                target = os.path.join(d, path)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(base[path])
        out = subprocess.run(["git", "apply", "--whitespace=nowarn", "-p1", "-"], cwd=d,
                             input=patch.encode(), capture_output=True)
        if out.returncode != 0:
            return None
        tree = {}
        for path in touched:
            target = os.path.join(d, path)
            if os.path.isfile(target):
                with open(target, "rb") as f:
                    tree[path] = f.read()
        return tree


def reference_tree(base: dict[str, bytes], patch: str,
                   touched: set[str]) -> dict[str, bytes] | None:
    """The tree a reference ``patch`` (touching ``touched``) makes of the base (None if it
    does not apply)."""
    after = patched(base, patch, touched)
    if after is None:
        return None
    tree = {**base, **after}
    for path in touched - set(after):
        tree.pop(path, None)
    return tree


def refused(base: dict[str, bytes], tree: dict[str, bytes] | None, changed: set[str],
            test_files: set[str], native: bool, guard: bool = True
            ) -> tuple[str, bool] | None:
    """Why the candidate's change earns 0 before any test runs, and whether that is
    ``suspicious``: flagged by the screen (``graders/screen.py``), or native code added to a
    repository that builds none (``native``: the base does). ``tree``: the candidate's
    (None: the patch does not apply, which the harness says)."""
    if tree is None:
        return None
    if not native:
        why = native_change(base, tree, changed)
        if why:
            return why, False
    flagged = screen(base, tree, skip=test_files) if guard else None
    return (f"the change was screened out: {flagged}", True) if flagged else None


def unified_diff(base: dict[str, bytes], tree: dict[str, bytes]) -> str:
    """``git diff``-style patch from ``base`` to ``tree`` (binary files named only)."""
    out = []
    for path in sorted(set(base) | set(tree)):
        a, b = base.get(path), tree.get(path)
        if a == b:
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        if a is None:
            out.append("new file mode 100644\n")
        elif b is None:
            out.append("deleted file mode 100644\n")
        try:
            a_text, b_text = (a or b"").decode(), (b or b"").decode()
        except UnicodeDecodeError:
            out.append(f"Binary files a/{path} and b/{path} differ\n")
            continue
        for line in difflib.unified_diff(
                a_text.splitlines(True), b_text.splitlines(True),
                "/dev/null" if a is None else f"a/{path}",
                "/dev/null" if b is None else f"b/{path}"):
            out.append(line if line.endswith("\n")
                       else line + "\n\\ No newline at end of file\n")
    return "".join(out)
