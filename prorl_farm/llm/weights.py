"""Weight sync through each engine's own routes, verified before the backend serves again.

One call (:func:`sync`), in one of two modes. ``drain`` (strictly on-policy): drain the
backend, wait until no job is pinned to it, load the weights the engine's way, reset what
holds state computed with the old weights, check that the engine now computes what the
checkpoint computes, and only then resume it at the new policy version. ``in_place``
(nothing waits on the longest turn in flight): pause the engine, aborting what it is
generating (each request ends ``abort`` with the tokens it has, which the farm's sessions
keep and continue from), load, label the weights with the new version, resume, check; the
engine labels every token it samples with the version of the weights that sampled it
(vLLM's token route with ``--enable-scale-out``; the dev server), so a turn that straddles
the update records where its version changed. A backend whose check fails stays out of
the heap with the reason (``weights_error``: ``weights_mismatch`` and the largest logprob
error) until a later sync passes: it never serves a version it does not hold.

The engines' routes (from their own servers' code):

- vLLM (``VLLM_SERVER_DEV_MODE=1``): ``POST /collective_rpc {"method": "reload_weights",
  "kwargs": {"weights_path": DIR}}`` reloads in place; ``POST /reset_prefix_cache`` drops KV
  blocks computed with the old weights (without it, conversations sharing a cached prefix
  keep sampling from them); it answers ``{"success": false}`` while blocks are held.
- SGLang: ``POST /update_weights_from_disk {"model_path": DIR}``; ``POST /flush_cache``
  (400 while requests run).

The check: the probe's token ids go to the backend as a prompt with prompt logprobs (vLLM's
``prompt_logprobs``; SGLang's ``logprob_start_len: 0``, which both skip the prefix cache),
and each is compared with the logprob the trainer's model gives it (the probe it passes), or
that the checkpoint on disk gives it (computed here, in a child process, in float32).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

from prorl_farm import keys
from prorl_farm.errors import Conflict, FarmError
from prorl_farm.llm.backends.vllm import FAILED, UNCHECKED

log = logging.getLogger(__name__)

# A text every tokenizer splits into a few dozen tokens: the farm's own probe.
PROBE_TEXT = ("The farm checks new weights with this sentence: 12 + 30 = 42, and "
              "def f(x): return x * 2.")


class WeightSyncError(FarmError):
    """A load the engine refused, or that could not be made or checked (HTTP 422 at the
    API, with the reason)."""

    code = "weight_sync_failed"


@dataclass(frozen=True)
class Probe:
    """Token ids and, for each after the first, its logprob given those before it."""

    token_ids: list[int]
    logprobs: list[float]


def score(model_dir: str, token_ids: list[int]) -> Probe:
    """The probe of ``token_ids`` under the checkpoint at ``model_dir``: each token's
    logprob given those before it, teacher-forced in float32 (in this process: needs torch
    and transformers)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return Probe(list(token_ids),
                 [float(lp[i - 1, token_ids[i]]) for i in range(1, len(token_ids))])


def _http(method: str, url: str, body: dict | None = None, timeout_s: float = 600.0
          ) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        raise WeightSyncError(f"{url}: unreachable: {getattr(e, 'reason', e)}") from e


def _ok(what: str, status: int, text: str) -> None:
    if status == 404:
        raise WeightSyncError(f"{what}: 404: the engine does not offer this route (vLLM "
                              f"serves it only with VLLM_SERVER_DEV_MODE=1): {text[:200]}")
    if status >= 300:
        raise WeightSyncError(f"{what}: HTTP {status}: {text[:300]}")


def _refused(text: str) -> bool:
    """A 2xx answer that says ``{"success": false}`` (vLLM's cache reset while blocks are
    held, SGLang's load)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return False  # SGLang's /flush_cache answers plain text
    return isinstance(doc, dict) and doc.get("success") is False


# kind -> (the load's route, its body for a path, the cache reset's route)
ROUTES = {
    "vllm": ("/collective_rpc",
             lambda path: {"method": "reload_weights", "kwargs": {"weights_path": path}},
             "/reset_prefix_cache"),
    "sglang": ("/update_weights_from_disk", lambda path: {"model_path": path}, "/flush_cache"),
}


def load(kind: str, url: str, path: str, timeout_s: float = 600.0) -> None:
    """Load ``path`` into the engine and reset its prefix cache (retried while the engine
    says blocks are still held)."""
    if kind not in ROUTES:
        raise WeightSyncError(f"no weight loading for backend kind {kind!r}")
    route, body, reset = ROUTES[kind]
    url = url.rstrip("/")
    status, text = _http("POST", url + route, body(path), timeout_s)
    _ok(route, status, text)
    if _refused(text):
        raise WeightSyncError(f"{route}: {text[:300]}")
    for _ in range(20):
        status, text = _http("POST", url + reset, timeout_s=60)
        if status < 300 and not _refused(text):
            return
        if status == 404:
            _ok(reset, status, text)
        time.sleep(0.25)
    raise WeightSyncError(f"{reset}: the engine did not reset its cache in 20 tries: HTTP "
                          f"{status}: {text[:300]}")


def served_logprobs(kind: str, url: str, model: str, token_ids: list[int],
                    timeout_s: float = 120.0) -> list[float]:
    """The backend's logprob of each of ``token_ids`` after the first, given those before."""
    url = url.rstrip("/")
    neutral = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
               "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    if kind == "vllm":
        body = {"model": model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0,
                **neutral}
        status, text = _http("POST", url + "/v1/completions", body, timeout_s)
        _ok("prompt logprobs", status, text)
        try:
            rows = json.loads(text)["choices"][0]["prompt_logprobs"][1:]
            return [float(row[str(t)]["logprob"]) for row, t in zip(rows, token_ids[1:])]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise WeightSyncError(f"prompt logprobs: malformed answer ({e!r}): "
                                  f"{text[:200]}") from e
    body = {"input_ids": token_ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, **neutral}}
    status, text = _http("POST", url + "/generate", body, timeout_s)
    _ok("input logprobs", status, text)
    try:
        rows = json.loads(text)["meta_info"]["input_token_logprobs"]
        return [float(row[0]) for row in rows[1:]]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise WeightSyncError(f"input logprobs: malformed answer ({e!r}): {text[:200]}") from e


def checkpoint_probe(path: str, tokenizer: str | None = None, timeout_s: float = 600.0
                     ) -> Probe:
    """The probe of the checkpoint at ``path``: :data:`PROBE_TEXT` tokenized, and the
    checkpoint's own logprobs of it in float32 (a child process: the model's memory is
    freed when it ends)."""
    cmd = [sys.executable, "-m", "prorl_farm.llm.weights", path, tokenizer or path]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                             env=dict(os.environ, HF_HUB_OFFLINE="1"))
    except subprocess.TimeoutExpired as e:
        raise WeightSyncError(f"computing the checkpoint's probe took over {timeout_s} s") \
            from e
    if out.returncode != 0:
        tail = " ".join(out.stderr.strip().splitlines()[-3:])
        raise WeightSyncError(f"cannot compute a probe from {path} (pass one instead): "
                              f"{tail[-400:]}")
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    return Probe(doc["token_ids"], doc["logprobs"])


def compare(expected: Probe, served: list[float]) -> tuple[float, int]:
    """(largest absolute logprob error, its position in token_ids)."""
    if len(served) != len(expected.logprobs):
        raise WeightSyncError(f"the backend gave {len(served)} prompt logprobs for "
                              f"{len(expected.logprobs)} tokens")
    errors = [abs(a - b) for a, b in zip(served, expected.logprobs)]
    worst = max(range(len(errors)), key=errors.__getitem__)
    return errors[worst], worst + 1


# kind -> (pause route with abort, resume route, the weights' version label route)
PAUSE_ROUTES = {"vllm": ("/pause?mode=abort&clear_cache=true", "/resume",
                         "/update_weight_version")}
MODES = ("drain", "in_place")


def label_version(kind: str, url: str, version: int | str) -> bool:
    """Label the engine's weights with ``version`` (what it reports for the tokens they
    sample); False where the engine has no such label (then the farm labels tokens with
    the version the backend was pinned at)."""
    if kind not in PAUSE_ROUTES:
        return False
    status, text = _http("POST", url.rstrip("/") + PAUSE_ROUTES[kind][2],
                         {"new_version": str(version)}, 60)
    if status == 404:
        return False
    _ok("update_weight_version", status, text)
    return True


def sync(registry, backend_id: str, path: str, policy_version: int,
         probe: Probe | None = None, tolerance: float = 1e-2, drain_timeout_s: float = 600.0,
         verify: bool = True, mode: str = "drain") -> dict:
    """Drain, wait for in-flight 0, load, reset, verify, resume at ``policy_version``: one
    sync per backend at a time (another one meanwhile is a Conflict, ``sync_in_progress``).
    Returns the backend's record with ``weights`` (path, max error, tolerance). A mismatch
    leaves the backend out of the heap (``weights_error``) and returns it so; a load the
    engine refused raises :class:`WeightSyncError`, the backend kept out likewise."""
    b = registry.get(backend_id)  # NotFound first
    lock, token = keys.backend_sync(backend_id), uuid.uuid4().hex
    if not registry.r.set(lock, token, nx=True, ex=int(drain_timeout_s + 3600)):
        raise Conflict("sync_in_progress", f"backend {backend_id}: another weight sync is "
                       "under way")
    try:
        if mode == "in_place":
            return _sync_in_place(registry, b, path, policy_version, probe, tolerance,
                                  verify)
        return _sync(registry, b, path, policy_version, probe, tolerance, drain_timeout_s,
                     verify)
    finally:
        registry.lua("release_lock", lock=lock, value=token)


def _prepare(b: dict, path: str, policy_version: int, probe: Probe | None,
             verify: bool, try_probe: bool = True) -> Probe | None:
    """What both modes check before anything changes; the probe to verify with.
    ``try_probe``: send the probe to the engine first (drain mode: an engine that refuses
    it refuses it before anything changed; in place it would queue behind the turns in
    flight on an engine that batches by rounds)."""
    backend_id = b["id"]
    if policy_version < b["policy_version"]:
        raise Conflict("policy_version_regressed", f"backend {backend_id}: policy_version "
                       f"{policy_version} is lower than its current {b['policy_version']} "
                       f"(versions only grow)")
    if not b["healthy"]:
        raise WeightSyncError(f"backend {backend_id} is unhealthy ({b['last_error']}); "
                              "nothing was loaded")
    if probe is None and verify:
        if not os.path.isdir(path):
            raise WeightSyncError(f"path: {path} is not a directory here, so the farm cannot "
                                  "compute the check's probe from it: pass a probe (or "
                                  "verify: false)")
        probe = checkpoint_probe(path, b["tokenizer"])  # before draining: may take a while
    if probe is not None and try_probe:
        # The probe on the weights served now: a probe the engine refuses (token ids out
        # of its vocabulary, longer than its context) fails here, before anything changed.
        served_logprobs(b["kind"], b["url"], b["model"], probe.token_ids)
    return probe


def _sync_in_place(registry, b: dict, path: str, policy_version: int, probe: Probe | None,
                   tolerance: float, verify: bool) -> dict:
    backend_id, kind, url = b["id"], b["kind"], b["url"].rstrip("/")
    if kind not in PAUSE_ROUTES:
        raise WeightSyncError(f"backend {backend_id} ({kind}) cannot update in place (no "
                              "pause with abort the farm knows of): use mode drain")
    probe = _prepare(b, path, policy_version, probe, verify, try_probe=False)
    pause, resume, _ = PAUSE_ROUTES[kind]
    started = time.monotonic()
    try:
        status, text = _http("POST", url + pause, timeout_s=600)
        _ok("pause", status, text)
    except WeightSyncError as e:  # nothing changed; the engine is not answering as it should
        registry.mark_unhealthy(backend_id, f"pause failed: {e}"[:500])
        raise
    paused_s = time.monotonic() - started
    try:
        load(kind, url, path)
        # Labelled unchecked until the check below passes: the sessions hold the tokens
        # these weights sample until then (and give them up if it fails).
        if not label_version(kind, url, f"{policy_version}{UNCHECKED}"):
            raise WeightSyncError(f"backend {backend_id}: the engine cannot label its "
                                  "weights' version (/update_weight_version), so tokens "
                                  "sampled across the update could not say which weights "
                                  "sampled them: use mode drain")
        status, text = _http("POST", url + resume, timeout_s=60)
        _ok("resume", status, text)
        out = _verified(registry, b, path, policy_version, probe, tolerance, verify,
                        time.monotonic() - started,
                        {"weights_mode": "in_place", "weights_paused_s": f"{paused_s:.3f}"})
    except WeightSyncError as e:
        # Out of the heap, and the jobs pinned to it move on (backend_acquire); what the
        # engine samples now is labelled as no version, so no session keeps it.
        if not registry.get(backend_id)["weights"]["error"]:
            registry.set_fields(backend_id, weights_error=f"load_failed: {e}"[:500],
                                weights_path=path)
        if _label_failed(kind, url, policy_version):
            try:  # the requests held by the pause end, and fail over
                _http("POST", url + resume, timeout_s=60)
            except WeightSyncError:
                pass
        raise
    if out["weights"]["error"]:
        _label_failed(kind, url, policy_version)
    else:
        label_version(kind, url, policy_version)
    return out


def _label_failed(kind: str, url: str, policy_version: int) -> bool:
    """Label the engine's weights as no version (tokens they sample are not kept)."""
    try:
        return label_version(kind, url, f"{FAILED}{policy_version}")
    except WeightSyncError:
        return False


def _sync(registry, b: dict, path: str, policy_version: int, probe: Probe | None,
          tolerance: float, drain_timeout_s: float, verify: bool) -> dict:
    backend_id = b["id"]
    probe = _prepare(b, path, policy_version, probe, verify)
    was_drained = b["drained"]
    registry.drain(backend_id)
    end = time.monotonic() + drain_timeout_s
    while registry.get(backend_id)["in_flight"] > 0:
        if time.monotonic() > end:
            if not was_drained:
                registry.set_fields(backend_id, drained=0)
            raise Conflict("drain_timeout", f"backend {backend_id} still had jobs in flight "
                           f"after {drain_timeout_s:g} s; nothing was loaded")
        time.sleep(0.05)
    started = time.monotonic()
    try:
        load(b["kind"], b["url"], path)
        label_version(b["kind"], b["url"], policy_version)
    except WeightSyncError as e:
        registry.set_fields(backend_id, weights_error=f"load_failed: {e}"[:500],
                            weights_path=path)
        raise
    return _verified(registry, b, path, policy_version, probe, tolerance, verify,
                     time.monotonic() - started, {"weights_mode": "drain"})


def _verified(registry, b: dict, path: str, policy_version: int, probe: Probe | None,
              tolerance: float, verify: bool, loaded_s: float, extra: dict) -> dict:
    """Check the loaded weights with the probe; resume at ``policy_version`` if they pass,
    keep the backend out (``weights_error``) if not."""
    backend_id = b["id"]
    max_error, at = None, None
    if verify:
        try:
            served = served_logprobs(b["kind"], b["url"], b["model"], probe.token_ids)
            max_error, at = compare(probe, served)
        except WeightSyncError as e:
            registry.set_fields(backend_id, weights_error=f"unverified: {e}"[:500],
                                weights_path=path)
            raise
    fields = {"weights_path": path, "weights_load_s": f"{loaded_s:.3f}",
              "weights_max_error": "" if max_error is None else f"{max_error:.3g}",
              "weights_checked_at": f"{time.time():.3f}", **extra}
    if max_error is not None and max_error > tolerance:
        why = (f"weights_mismatch: logprob error {max_error:.3g} at probe token {at} "
               f"exceeds {tolerance:g}: the backend does not compute what {path} computes")
        log.error("backend %s: %s", backend_id, why)
        registry.set_fields(backend_id, weights_error=why, **fields)
        return registry.get(backend_id)
    registry.set_fields(backend_id, weights_error="", **fields)
    out = registry.resume(backend_id, policy_version)
    log.info("backend %s: loaded %s in %.2f s, verified (max error %s), serving version %d",
             backend_id, path, loaded_s, fields["weights_max_error"] or "unchecked",
             policy_version)
    return out


def _main(argv: list[str]) -> None:
    """``python -m prorl_farm.llm.weights MODEL_DIR TOKENIZER_DIR``: print the probe."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(argv[1])
    ids = tok.encode(PROBE_TEXT, add_special_tokens=False)
    if len(ids) < 8:  # a vocabulary that cannot spell it (a character-level one, say)
        ids = [i % len(tok) for i in range(3, 35)]
    probe = score(argv[0], ids)
    print(json.dumps({"token_ids": probe.token_ids, "logprobs": probe.logprobs}))


if __name__ == "__main__":
    _main(sys.argv[1:])
