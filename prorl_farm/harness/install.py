"""Installing a preset: a virtualenv of the system's Python with its pinned packages, and
the npm binaries it runs, checked against their pinned integrity."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

from prorl_farm.harness.presets import PRESETS, NpmBinary

ROOT = Path(__file__).resolve().parents[2]
NPM_REGISTRY = "https://registry.npmjs.org"

SYSTEM_PYTHON = "/usr/bin/python3"


def install(name: str, into: str, python: str = "", cache: str = "") -> Path:
    """Build preset ``name``'s environment under ``into``, idempotent; returns its
    directory. It is a venv of the system's Python (``/usr/bin/python3``, which a sandbox
    sees as /usr is bound in), not of the farm's own interpreter, which may live anywhere.
    Its packages are pinned by ``locks/harness-NAME.txt`` where the checkout has one (``make
    lock`` writes it); built by uv where there is one (the checkout's ``.uv/bin/uv``, as
    `make` installs it, or uv on the PATH), else by venv and pip."""
    preset = PRESETS[name]
    env = Path(into) / preset.env
    stamp = env / ".installed"
    base = python or (SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable)
    lock = ROOT / "locks" / f"harness-{name}.txt"
    pins = lock.read_text() if lock.exists() else ""
    want = "\n".join((base, *preset.packages, *sorted(preset.files), pins,
                      *(f"{b.package}@{b.version} {b.integrity}" for b in preset.binaries)))
    if not (stamp.exists() and stamp.read_text() == want):
        if env.exists():
            shutil.rmtree(env)
        constraints = ["-c", str(lock)] if pins else []
        uv = uv_binary()
        if not preset.packages:  # a program of its own: no Python environment
            env.mkdir(parents=True)
        elif uv:  # copies, not links into uv's cache (which a sandbox's uid may not read);
            # compiled, as pip does: read-only in a sandbox, it could not be compiled there
            subprocess.run([uv, "venv", "--quiet", "--python", base, str(env)], check=True)
            subprocess.run([uv, "pip", "install", "--quiet", "--link-mode", "copy",
                            "--compile-bytecode",
                            "--python", str(env / "bin" / "python"), *constraints,
                            *preset.packages], check=True)
        else:
            subprocess.run([base, "-m", "venv", str(env)], check=True)
            subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q",
                            "--disable-pip-version-check", *constraints, *preset.packages],
                           check=True)
        for binary in preset.binaries:
            _npm_binary(binary, env, npm_cache(cache))
        for inside, source in preset.files.items():
            (env / inside).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / source, env / inside)
        stamp.write_text(want)
    subprocess.run(["chmod", "-R", "a+rX", str(Path(into))], check=True)
    return env


def npm_cache(configured: str = "") -> Path:
    """Where downloaded npm tarballs are kept: the setting (``PRORL_NPM_CACHE``), else the
    user's cache directory."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prorl-farm"
    return Path(configured) if configured else default / "npm"


def _npm_binary(binary: NpmBinary, env: Path, cache: Path) -> None:
    """Put ``binary`` in ``env``: its tarball from the cache, or downloaded from the registry
    into it; either way checked against the pinned integrity first."""
    algo, _, digest = binary.integrity.partition("-")
    name = binary.package.rsplit("/", 1)[-1]
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"{binary.package.replace('/', '+')}-{binary.version}.tgz"

    def intact() -> bool:
        h = hashlib.new(algo)
        with open(tarball, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return base64.b64encode(h.digest()).decode() == digest

    if not (tarball.exists() and intact()):
        url = f"{NPM_REGISTRY}/{binary.package}/-/{name}-{binary.version}.tgz"  # as npm's
        part = tarball.with_suffix(f".part{os.getpid()}")
        with urllib.request.urlopen(url, timeout=600) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        os.replace(part, tarball)
        if not intact():
            tarball.unlink()
            raise RuntimeError(f"{binary.package}@{binary.version}: the download does not "
                               f"match its pinned integrity {binary.integrity}")
    dest = env / binary.dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        src = tar.extractfile(binary.member)
        if src is None:
            raise RuntimeError(f"{binary.package}@{binary.version} has no {binary.member}")
        with src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    dest.chmod(0o755)


def uv_binary() -> str | None:
    """The checkout's uv (``make`` puts it in ``.uv/``), else one on the PATH."""
    for candidate in (str(ROOT / ".uv" / "bin" / "uv"), shutil.which("uv") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None
