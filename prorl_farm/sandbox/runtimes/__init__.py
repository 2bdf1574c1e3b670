"""The sandbox runtimes, one module each, and the table that makes one by name
(``PRORL_SANDBOX_RUNTIME``): ``local`` (no isolation), ``bwrap`` (bubblewrap, rootless),
``apptainer`` (HPC images), ``docker``. Each implements ``sandbox.abstract.Runtime``."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from prorl_farm.errors import SandboxError
from prorl_farm.sandbox.abstract import Runtime
from prorl_farm.sandbox.runtimes.apptainer import ApptainerRuntime
from prorl_farm.sandbox.runtimes.bwrap import BwrapRuntime
from prorl_farm.sandbox.runtimes.docker import DockerRuntime
from prorl_farm.sandbox.runtimes.local import LocalRuntime


@dataclass(frozen=True)
class RuntimeOptions:
    """What a node's sandbox manager gives its runtime: where sandboxes live on the host,
    the host uid/gid they run as (None: the farm's own), the tool server's interpreter
    (empty: the farm's), the read-only paths of every sandbox ({inside: host}), and the
    image of an image runtime's sandboxes whose spec names none."""

    sandbox_root: Path
    run_as: tuple[int, int] | None = None
    python: str = ""
    ro_paths: dict[str, str] = field(default_factory=dict)
    image: str = ""


RUNTIMES: dict[str, type[Runtime]] = {
    kind.name: kind for kind in (LocalRuntime, BwrapRuntime, ApptainerRuntime, DockerRuntime)}
# Those whose sandboxes get the model gateway's door (agent harnesses run only there).
GATEWAY_RUNTIMES = tuple(name for name, kind in RUNTIMES.items() if kind.serves_gateway)


def make_runtime(name: str, options: RuntimeOptions) -> Runtime:
    """The runtime ``name`` (``auto``: ``bwrap`` where bubblewrap is installed, else
    ``local``)."""
    if name == "auto":
        name = "bwrap" if shutil.which("bwrap") else "local"
    if name not in RUNTIMES:
        raise SandboxError(f"unknown sandbox runtime {name!r}; expected one of "
                           f"{', '.join(RUNTIMES)} or auto")
    return RUNTIMES[name].from_options(options)
