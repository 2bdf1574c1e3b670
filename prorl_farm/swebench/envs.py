"""Environments for real SWE instances, built once per (repository, version) and shared,
read-only, by every job that needs one.

An environment is what SWE-bench's environment image holds, without the image: the spec's
Python (a pyenv interpreter, or one from ``PRORL_SWE_PYTHONS``), the spec's packages at the
versions of its lock file (``prorl_farm/swebench/locks``; without a lock they are resolved
from the package registry and the result is reported as unpinned), and the repository
installed in editable mode from ``/workspace``, the path where a job's sandbox has its
checkout. It is built on the host, with the package registry, in a bubblewrap namespace
that shows the interpreter's copy at the interpreter's own path and the repository's tree
at ``/workspace``, so that every path the install writes (script shebangs, the editable
finder) is the one a sandbox sees. What the install wrote into the tree (``*.egg-info``, a
generated ``_version.py``) is kept as the environment's *overlay*, laid into each job's
checkout as SWE-bench's image has it.

Two layers, as SWE-bench's environment and instance images: the interpreter and the
packages, built from the ``environment_setup_commit`` and shared by every instance of
(repository, version); over it (hard links), the repository installed from the instance's
own base commit, so that nothing of a later commit (its version, its file list in
``SOURCES.txt``) is in an agent's sight. A sandbox gets the instance's layer bound
read-only at the interpreter's path; whatever a job writes goes to its own workspace.
Builds are cached by content (spec, interpreter, lock, commits): a second job, or a second
process, finds the environment ready, and two that ask at once build it once (the second
waits on a lock file).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prorl_farm.errors import InvalidInstance
from prorl_farm.harness import uv_binary
from prorl_farm.swebench.repos import _Locked

HERE = Path(__file__).resolve().parent
SPECS_FILE = HERE / "specs.json"
LOCKS_DIR = HERE / "locks"
# Part of every environment's cache key: raised whenever what a build makes (its files or its
# manifest) changes, so no environment an older builder made is taken for a newer one's.
# 2: the manifest says where the lock came from (lock_source).
BUILDER_VERSION = 2
INSIDE_SRC = "/workspace"
BUILD_DIR = "/tmp/prorl-build"
CACHE_DIR = "/tmp/prorl-cache"
UV_INSIDE = "/tmp/prorl-uv"
# Passed to the build from the farm's environment (how this host reaches the registry).
PASS_ENV = re.compile(r"^(PIP_\w+|UV_\w+|(https?|no|all)_proxy|(HTTPS?|NO|ALL)_PROXY|"
                      r"SSL_CERT_(FILE|DIR)|REQUESTS_CA_BUNDLE)$")
SKIP_TOP = {"proc", "dev", "sys", "tmp", "run", "workspace", "lost+found"}


# A repository's files: {path: content}, or a function that reads them.
Tree = dict[str, bytes] | Callable[[], dict[str, bytes]]


class EnvError(InvalidInstance):
    """The environment could not be built: the instance cannot be graded here."""


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """SWE-bench's installation spec for one (repository, version)."""

    repo: str
    version: str
    python: str
    install: str = ""
    packages: str = ""
    pip_packages: tuple[str, ...] = ()
    pre_install: tuple[str, ...] = ()
    eval_commands: tuple[str, ...] = ()
    test_cmd: str = "pytest -rA"
    env: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.repo.replace('/', '__')}@{self.version}"

    def lock_file(self, dirs: tuple[str, ...] = ()) -> Path | None:
        """The lock of this environment: the first ``NAME.txt`` in ``dirs`` (a user's own
        locks), then the package's; None without one."""
        for d in (*map(Path, dirs), LOCKS_DIR):
            if (d / f"{self.name}.txt").exists():
                return d / f"{self.name}.txt"
        return None

    def lock(self, dirs: tuple[str, ...] = ()) -> str | None:
        path = self.lock_file(dirs)
        return path.read_text() if path is not None else None

    def build_lock(self, dirs: tuple[str, ...] = ()) -> str | None:
        """The versions of the repository's build backend (its ``build-system``), beside the
        lock."""
        path = self.lock_file(dirs)
        build = path.with_name(f"{self.name}.build.txt") if path is not None else None
        return build.read_text() if build is not None and build.exists() else None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=4)
def load_specs(path: Path = SPECS_FILE) -> dict:
    """``{"specs": {repo: {version: spec}}, "requirements_paths": {repo: [path, ...]}}``."""
    return json.loads(path.read_text())


def spec_for(repo: str, version: str | None, specs: dict | None = None) -> EnvSpec | None:
    """The spec of ``repo`` at ``version``, or None when the farm has none."""
    table = (specs if specs is not None else load_specs())["specs"].get(repo, {})
    raw = table.get(str(version)) if version is not None else None
    if raw is None:
        return None
    return EnvSpec(repo=repo, version=str(version), python=raw["python"],
                   install=raw.get("install", ""), packages=raw.get("packages", ""),
                   pip_packages=tuple(raw.get("pip_packages", ())),
                   pre_install=tuple(raw.get("pre_install", ())),
                   eval_commands=tuple(raw.get("eval_commands", ())),
                   test_cmd=raw.get("test_cmd", "pytest -rA"),
                   env=tuple(sorted(raw.get("env", {}).items())))


# -- interpreters ------------------------------------------------------------------------


def find_python(version: str, configured: str = "") -> str:
    """The interpreter for Python ``version`` (``3.9``): from ``configured``
    (``3.9=/path/python3.9,...``), else the newest pyenv build of it."""
    for item in filter(None, (x.strip() for x in configured.split(","))):
        want, _, path = item.partition("=")
        if want == version:
            return path
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    found = []
    if pyenv.is_dir():
        for d in pyenv.iterdir():
            parts = d.name.split(".")
            if ".".join(parts[:2]) == version and all(p.isdigit() for p in parts):
                exe = d / "bin" / f"python{version}"
                if exe.exists():
                    found.append((tuple(int(p) for p in parts), str(exe)))
    if found:
        return max(found)[1]
    raise EnvError(f"no Python {version} for this environment: install it with pyenv or "
                   f"name it in PRORL_SWE_PYTHONS ({version}=/path/to/python{version})")


@functools.lru_cache(maxsize=16)
def _interpreter(exe: str) -> tuple[str, str]:
    """(its prefix, its full version)."""
    out = subprocess.run([exe, "-I", "-c", "import sys, platform; print(sys.prefix); "
                          "print(platform.python_version())"], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise EnvError(f"{exe} does not run: {out.stderr[-500:]}")
    prefix, version = out.stdout.split()
    prefix = os.path.realpath(prefix)
    if prefix == "/usr" or prefix.startswith(("/usr/", "/etc/", "/workspace")):
        raise EnvError(f"{exe}: its prefix {prefix} cannot be shown at its own path beside "
                       "the system's; use a pyenv (or other self-contained) build")
    return prefix, version


# -- requirements from the tree ---------------------------------------------------------


def requirements_from_tree(files: dict[str, bytes], paths: list[str]) -> str:
    """SWE-bench's ``get_requirements_by_commit``, on the tree we hold: the first of
    ``paths`` that exists, its ``-r`` includes inlined; ``-e .``, comments and ``.[test``
    lines left out."""
    for path in paths:
        if path in files:
            break
    else:
        raise EnvError(f"none of {paths} is in the tree")
    base = os.path.dirname(path)
    out: list[str] = []

    def read(rel: str) -> None:
        for line in files.get(rel, b"").decode().splitlines():
            s = line.strip()
            if s.startswith("-r"):
                read(os.path.normpath(os.path.join(base, s[2:].strip())))
            elif s and not s.startswith(("-e .", "#", ".[test")):
                # SWE-bench's REPLACE_REQ_PACKAGES: a stub package gone from the registry.
                out.append(re.sub(r"^types-pkg_resources(?=[<>=!~ ]|$)", "types-setuptools",
                                  line))
    read(path)
    return "\n".join(out) + "\n"


def build_requires(files: dict[str, bytes]) -> list[str]:
    """The tree's ``[build-system] requires`` (setuptools and wheel where it has none)."""
    text = files.get("pyproject.toml")
    if text:
        import tomllib

        try:
            requires = tomllib.loads(text.decode()).get("build-system", {}).get("requires")
        except (ValueError, UnicodeDecodeError):
            requires = None
        if requires:
            return list(requires)
    return ["setuptools", "wheel"]


# -- the environment ---------------------------------------------------------------------


@dataclasses.dataclass
class Env:
    path: str  # on the host
    manifest: dict

    @property
    def prefix(self) -> str:
        """The interpreter's prefix, inside a sandbox."""
        return self.manifest["prefix"]

    @property
    def python(self) -> str:
        return self.manifest["python"]

    @property
    def ro_paths(self) -> dict[str, str]:
        return {self.prefix: os.path.join(self.path, "python")}

    @property
    def path_env(self) -> str:
        return f"{self.prefix}/bin:/usr/local/bin:/usr/bin:/bin"

    @property
    def sandbox_env(self) -> dict[str, str]:
        return {"PATH": self.path_env, **dict(self.manifest.get("env", {}))}

    def overlay(self) -> dict[str, bytes]:
        root = Path(self.path) / "overlay"
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and not p.is_symlink()}


def _link(src, dst) -> None:
    """A hard link where the filesystem allows, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy_interpreter(prefix: str, dest: Path, version: str) -> None:
    """The interpreter's tree (hard links where the filesystem allows), without its test
    suite or any installed package."""
    short = ".".join(version.split(".")[:2])
    lib = f"lib/python{short}"

    def ignore(directory, names):
        rel = os.path.relpath(directory, prefix)
        if rel == lib:
            return {"test", "site-packages"} & set(names)
        return {"__pycache__"} & set(names) if rel.startswith(f"{lib}/test") else set()

    shutil.copytree(prefix, dest, symlinks=True, ignore=ignore, copy_function=_link)
    (dest / lib / "site-packages").mkdir(exist_ok=True)


def _link_tree(src: Path, dest: Path, site: str) -> None:
    """``src`` again at ``dest``, by hard links (the layer below stays as it is: installers
    write new files, never into old ones); the files at the top of ``site`` (``.pth``
    files, which an install may append to) are copied."""
    def link(a, b):
        if os.path.dirname(os.path.relpath(a, src)) == site:
            shutil.copy2(a, b)
        else:
            _link(a, b)

    shutil.copytree(src, dest, symlinks=True, copy_function=link)


def _bwrap_argv(python_dir: Path, prefix: str, src: Path, build: Path, cache: Path,
                env: dict[str, str], uv: str | None = None) -> list[str]:
    """The build's namespace: the host read-only (its /tmp fresh, so a checkout or a uv
    under /tmp is bound in by name), the interpreter's copy at its own path, the tree at
    /workspace, the build and cache directories writable; the network shared."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise EnvError("bubblewrap (bwrap) is needed to build SWE environments")
    argv = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--tmpfs", "/"]
    for name in sorted(os.listdir("/")):
        if name in SKIP_TOP:
            continue
        host = f"/{name}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run",
             "--bind", str(python_dir), prefix, "--bind", str(src), INSIDE_SRC,
             "--bind", str(build), BUILD_DIR, "--bind", str(cache), CACHE_DIR,
             "--chdir", INSIDE_SRC, "--clearenv"]
    if uv:
        argv += ["--ro-bind", uv, UV_INSIDE]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv


@dataclasses.dataclass(frozen=True)
class _Layer:
    """What one layer's install steps are made from."""
    spec: EnvSpec
    files: dict[str, bytes]  # the tree the layer installs from
    build: Path  # the build directory (BUILD_DIR inside)
    python: str  # the interpreter's path inside
    short: str  # its version, major.minor
    uv: str | None  # uv's path inside (None: pip alone)
    first: bool  # the interpreter and the packages (else the repository over them)
    install: bool  # the repository is installed in this layer


def _resolving_steps(layer: _Layer, resolve: bool) -> list[tuple[str, str]]:
    """An unpinned layer's steps (no lock, or ``resolve``: making one): the spec's packages
    resolved from the registry, the repository, and the record of what was installed (and,
    for a lock, the build backend's versions)."""
    spec, build, uv = layer.spec, layer.build, layer.uv
    steps = []
    if layer.first:
        steps.append(("pip", "python -m ensurepip --default-pip"))
        if spec.pip_packages:
            (build / "pip.txt").write_text("\n".join(spec.pip_packages) + "\n")
            steps.append(("the spec's pip packages",
                          f"python -m pip install -r {BUILD_DIR}/pip.txt"))
        if spec.packages == "requirements.txt":
            paths = load_specs()["requirements_paths"].get(spec.repo, ["requirements.txt"])
            (build / "reqs.txt").write_text(requirements_from_tree(layer.files, paths))
            steps.append(("the repository's requirements",
                          f"python -m pip install -r {BUILD_DIR}/reqs.txt"))
        elif spec.packages and not spec.packages.endswith((".yml", ".yaml")):
            steps.append(("the spec's packages", f"python -m pip install {spec.packages}"))
        elif spec.packages:
            raise EnvError(f"{spec.name}: a conda environment file is not supported")
    if layer.install and spec.install:
        steps.append(("the repository", spec.install))
    # What was installed, kept in the manifest (an unpinned build's only record).
    steps.append(("the record of what was installed", f"python -m pip freeze --all "
                  f"--exclude-editable > {BUILD_DIR}/lock.out"))
    if resolve and uv:  # the build backend's versions (a locked build constrains them)
        (build / "build.in").write_text("\n".join(build_requires(layer.files)) + "\n")
        steps.append(("the build backend's lock",
                      f"{uv} pip compile --quiet --no-header --python-version "
                      f"{layer.short} {BUILD_DIR}/build.in -o {BUILD_DIR}/build.out"))
    return steps


def _build_env(spec: EnvSpec, prefix: str) -> dict[str, str]:
    """The environment the install steps run in: the host's proxy and index settings, the
    interpreter first on PATH, caches in the shared cache, the spec's own variables."""
    env = {k: v for k, v in os.environ.items() if PASS_ENV.match(k)}
    env.update({"PATH": f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp",
                "LANG": "C.UTF-8", "XDG_CACHE_HOME": CACHE_DIR,
                "UV_CACHE_DIR": f"{CACHE_DIR}/uv", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "PIP_ROOT_USER_ACTION": "ignore",
                # A shallow tree has no history for setuptools-scm to read a version from.
                "SETUPTOOLS_SCM_PRETEND_VERSION": f"{spec.version}.0", **dict(spec.env)})
    return env


def _run_steps(spec: EnvSpec, argv: list[str], steps: list[tuple[str, str]],
               log: Callable[[str], None]) -> None:
    """Each step's command in the build sandbox ``argv``; the first that fails ends the
    build with its output's tail."""
    for what, command in steps:
        t0 = time.monotonic()
        out = subprocess.run([*argv, "bash", "-c", command], capture_output=True,
                             text=True, stdin=subprocess.DEVNULL, timeout=1800)
        if out.returncode != 0:
            raise EnvError(f"{spec.name}: installing {what} failed ({out.returncode}): "
                           f"{command}\n{(out.stdout + out.stderr)[-3000:]}")
        log(f"{spec.name}: {what} in {time.monotonic() - t0:.1f}s")


def _write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _keep_overlay(src: Path, files: dict[str, bytes], overlay: Path) -> list[str]:
    """The files the install wrote into the tree (not the tree's own, no bytecode), copied
    to ``overlay``: laid over the graded tree, as the image's tree holds them."""
    kept = []
    for path in sorted(src.rglob("*")):
        rel = str(path.relative_to(src))
        if (path.is_file() and not path.is_symlink() and rel not in files
                and "__pycache__" not in path.parts and not rel.endswith(".pyc")):
            target = overlay / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            kept.append(rel)
    return kept




EDITABLE = re.compile(r"^(?:python -m )?pip install (?:-e|--editable) ['\"]?([^'\" ]+)['\"]?$")


class EnvBuilder:
    @staticmethod
    def _install_locked(spec: EnvSpec, python: str, uv: str | None) -> str:
        """The spec's install command for a locked build: the packages are in already (no
        dependency resolution), the build backend at the lock's versions."""
        m = EDITABLE.match(spec.install.strip())
        if m and uv:
            target = m.group(1).split("[", 1)[0]  # extras: their packages are in the lock
            return (f"{uv} pip install --quiet --python {python} --no-deps --link-mode copy "
                    f"--build-constraints {BUILD_DIR}/build.txt -e {target}")
        if re.search(r"\bpip install\b", spec.install):
            return f"{spec.install} --no-deps -c {BUILD_DIR}/build.txt"
        return spec.install

    def __init__(self, root: str, pythons: str = "", lock_dirs: tuple[str, ...] = ()):
        self.root = Path(root)
        self.pythons = pythons
        self.lock_dirs = tuple(lock_dirs)

    def key(self, spec: EnvSpec, commit: str, exe: str, resolve: bool) -> tuple[str, str,
                                                                               str]:
        prefix, version = _interpreter(exe)
        lock = None if resolve else spec.lock(self.lock_dirs)
        blob = json.dumps({"spec": spec.as_dict(), "python": version, "prefix": prefix,
                           "lock": lock,
                           "build": None if resolve else spec.build_lock(self.lock_dirs),
                           "commit": commit, "builder": BUILDER_VERSION},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16], prefix, version

    def ensure(self, spec: EnvSpec, files: Tree, commit: str,
               log: Callable[[str], None] = lambda s: None, resolve: bool = False,
               base_files: Tree | None = None, base_commit: str = "") -> Env:
        """The environment of one instance, cached, as SWE-bench's two images: the spec's
        packages, built from ``files`` (the tree at ``commit``: the instance's
        ``environment_setup_commit``), shared by every instance of (repo, version); over it
        (hard links), the repository installed from ``base_files`` (the tree at
        ``base_commit``), so that nothing of a later commit (its version, its file list)
        shows. ``resolve``: ignore the lock, resolve from the registry and install the
        repository at ``commit`` in one build (to make a lock). A tree may be given as a
        function that reads it: read only where a layer is built (a job that finds its
        environment ready reads no tree for it)."""
        if spec.pre_install:
            raise EnvError(f"{spec.name}: the spec needs system packages "
                           f"({'; '.join(spec.pre_install)}), which a farm node does not "
                           "install")
        exe = find_python(spec.python, self.pythons)
        key, prefix, version = self.key(spec, commit, exe, resolve)
        if resolve:
            return self._cached(f"{spec.name}-{key}", lambda tmp: self._build(
                spec, files, commit, prefix, version, tmp, log, resolve=True))
        packages = self._cached(f"{spec.name}-{key}", lambda tmp: self._build(
            spec, files, commit, prefix, version, tmp, log, install=False))
        if base_files is None:
            base_files, base_commit = files, commit
        at = hashlib.sha256(f"{key} {base_commit}".encode()).hexdigest()[:16]
        return self._cached(f"{spec.name}-{at}", lambda tmp: self._build(
            spec, base_files, base_commit, prefix, version, tmp, log, over=packages))

    def _cached(self, name: str, build: Callable[[Path], dict]) -> Env:
        final = self.root / name
        if (final / "env.json").exists():
            return Env(str(final), json.loads((final / "env.json").read_text()))
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        with _Locked(self.root / f".{name}.lock"):
            if (final / "env.json").exists():
                return Env(str(final), json.loads((final / "env.json").read_text()))
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=self.root))
            try:
                manifest = build(tmp)
                (tmp / "env.json").write_text(json.dumps(manifest, indent=1))
                subprocess.run(["chmod", "-R", "a+rX", str(tmp)], check=True)
                os.rename(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return Env(str(final), manifest)

    def _build(self, spec: EnvSpec, files: Tree, commit: str, prefix: str,
               version: str, tmp: Path, log: Callable[[str], None], resolve: bool = False,
               install: bool = True, over: Env | None = None) -> dict:
        """One layer: the interpreter and the packages (``over`` None), or the repository
        installed over the packages of ``over``."""
        files = files() if callable(files) else files
        started = time.monotonic()
        lock = None if resolve else spec.lock(self.lock_dirs)
        lock_file = None if lock is None else spec.lock_file(self.lock_dirs)
        short = ".".join(version.split(".")[:2])
        python = f"{prefix}/bin/python{short}"
        if over is None:
            log(f"{spec.name}: Python {version} from {prefix}")
            _copy_interpreter(prefix, tmp / "python", version)
        else:
            log(f"{spec.name}: the repository at {commit[:12]}")
            _link_tree(Path(over.path) / "python", tmp / "python",
                       f"lib/python{short}/site-packages")
        src, build, cache = tmp / "src", tmp / "build", self.root / ".cache"
        for d in (src, build, cache):
            d.mkdir(parents=True, exist_ok=True)
        if install:
            _write_tree(src, files)
        uv_host = uv_binary()
        layer = _Layer(spec, files, build, python, short, UV_INSIDE if uv_host else None,
                       first=over is None, install=install)
        if lock is None and over is None:
            log(f"{spec.name}: no lock, resolving from the registry (unpinned)")
        steps = (self._locked_steps(layer, lock) if lock is not None
                 else _resolving_steps(layer, resolve))
        _run_steps(spec, _bwrap_argv(tmp / "python", prefix, src, build, cache,
                                     _build_env(spec, prefix), uv_host), steps, log)
        kept = _keep_overlay(src, files, tmp / "overlay")
        shutil.rmtree(src)
        manifest = {"repo": spec.repo, "version": spec.version, "spec": spec.as_dict(),
                    "python": python, "prefix": prefix, "python_version": version,
                    "commit": commit, "locked": lock is not None,
                    "lock_source": None if lock_file is None else (
                        "package" if lock_file.parent == LOCKS_DIR else str(lock_file)),
                    "overlay": kept,
                    "plugins": self._plugins(tmp / "python" / "bin" / f"python{short}"),
                    "env": dict(spec.env), "built_s": round(time.monotonic() - started, 1)}
        if lock is None and (build / "lock.out").exists():
            manifest["resolved"] = (build / "lock.out").read_text()
            if (build / "build.out").exists():
                manifest["resolved_build"] = (build / "build.out").read_text()
        shutil.rmtree(build)
        log(f"{spec.name}: ready in {manifest['built_s']}s")
        return manifest

    def _locked_steps(self, layer: _Layer, lock: str) -> list[tuple[str, str]]:
        """A locked layer's steps: the packages at the lock's pins, no dependency
        resolution (the first layer); the repository with its build backend at the lock's
        versions (the second)."""
        spec, python, uv, build = layer.spec, layer.python, layer.uv, layer.build
        steps = []
        if layer.first:
            (build / "lock.txt").write_text(lock)
            if uv:
                steps.append(("packages from the lock", f"{uv} pip install --quiet "
                              f"--python {python} --no-deps --link-mode copy "
                              f"--compile-bytecode -r {BUILD_DIR}/lock.txt"))
            else:
                steps.append(("packages from the lock", f"{python} -m pip install -q "
                              f"--no-deps -r {BUILD_DIR}/lock.txt"))
        if layer.install and spec.install:
            (build / "build.txt").write_text(spec.build_lock(self.lock_dirs) or "")
            steps.append(("the repository", self._install_locked(spec, python, uv)))
        return steps

    @staticmethod
    def _plugins(python: Path) -> list[str]:
        """The modules of the pytest plugins installed in the environment (its
        ``pytest11`` entry points): loaded by name at grading, where autoloading is off."""
        code = ("import importlib.metadata as m, json\n"
                "eps = m.entry_points()\n"
                "group = eps.select(group='pytest11') if hasattr(eps, 'select') "
                "else eps.get('pytest11', [])\n"
                "print(json.dumps(sorted({e.value.split(':')[0] for e in group})))")
        out = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=120, cwd="/")
        return json.loads(out.stdout) if out.returncode == 0 else []

