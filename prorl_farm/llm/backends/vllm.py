"""vLLM, token-in/token-out: ``POST /inference/v1/generate`` (vLLM's own token route: ids,
their logprobs, and the weight version spans that sampled them, which weight updates in
place rely on), or, on a server without it (older vLLM), the OpenAI-compatible
``/v1/completions`` with a token-ID prompt."""

from __future__ import annotations

import logging
import time

from prorl_farm.errors import BackendError, BackendRequestError
from prorl_farm.llm.backends.abstract import MAX_TOKENS, Generation, LLMClient, explicit_sampling

# Sampling fields passed through as vLLM names them.
PASS_THROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos")
log = logging.getLogger(__name__)
TOKENS_ROUTE = "/inference/v1/generate"
# Servers (by URL) found without the token route: this process asks them by completions.
_WITHOUT_TOKENS_ROUTE: set[str] = set()


# The label of weights loaded in place that the farm has not checked yet ("8:unchecked"):
# weights.py sets it before the engine resumes and the plain version once the check passed.
UNCHECKED = ":unchecked"
# The label of weights whose update failed ("failed-8"): their tokens are never kept.
FAILED = "failed-"


def version_label(label) -> tuple[int, bool] | None:
    """A weight version label as (version, checked); None where the engine has none the farm
    set (no label, or vLLM's own "default" before any). Weights whose update failed raise
    BackendError: their tokens are not kept."""
    if label is None:
        return None
    text = str(label)
    if text.startswith(FAILED):
        raise BackendError(f"the engine labels its weights {text!r}: a weight update "
                           "failed there, so its tokens are not kept")
    checked = not text.endswith(UNCHECKED)
    try:
        return int(text if checked else text[:-len(UNCHECKED)]), checked
    except ValueError:
        return None


def versions_of(spans) -> tuple[list[tuple[int, int]], int | None]:
    """vLLM's weight version spans ([{version, start, end}]) as (first token, version) at
    each change, and the version among them not yet checked (or None); ([], None) where
    a span has no version at all."""
    out: list[tuple[int, int]] = []
    unchecked = None
    for span in spans or []:
        label = version_label(span.get("version") if isinstance(span, dict) else None)
        if label is None:
            return [], None
        version, checked = label
        if not checked:
            unchecked = version
        if not out or out[-1][1] != version:
            out.append((int(span["start"]), version))
    return out, unchecked


class VLLMClient(LLMClient):
    kind = "vllm"

    def generate(self, prompt_ids: list[int], sampling: dict, abort_hook=None) -> Generation:
        sampling = explicit_sampling(sampling)
        params = {"max_tokens": sampling.get("max_tokens", MAX_TOKENS),
                  **{k: sampling[k] for k in PASS_THROUGH if sampling.get(k) is not None}}
        if self.url not in _WITHOUT_TOKENS_ROUTE:
            t0 = time.monotonic()
            try:
                doc = self.post_json(TOKENS_ROUTE, {
                    "model": self.model, "token_ids": prompt_ids,
                    "sampling_params": {**params, "logprobs": 0,  # the sampled token's only
                                        "skip_special_tokens": False}}, abort_hook)
            except BackendRequestError as e:
                # 404: an older vLLM; 403: one started without --enable-scale-out.
                if not str(e).startswith(("HTTP 404", "HTTP 403")):
                    raise
                log.warning("%s has no token route (%s): sampling through /v1/completions, "
                            "without per-token weight versions (start vLLM with "
                            "--enable-scale-out for them)", self.url, str(e)[:120])
                _WITHOUT_TOKENS_ROUTE.add(self.url)
            else:
                return _from_tokens(doc, 1000 * (time.monotonic() - t0))
        body = {"model": self.model, "prompt": prompt_ids, **params,
                "logprobs": 0,  # the sampled token's logprob only
                "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False}
        t0 = time.monotonic()
        doc = self.post_json("/v1/completions", body, abort_hook)
        return _from_completion(doc, 1000 * (time.monotonic() - t0))


def _from_tokens(doc: dict, latency_ms: float) -> Generation:
    try:
        choice = doc["choices"][0]
        ids = [int(t) for t in choice["token_ids"] or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        if [int(c["token_id"]) for c in content] != ids:
            raise BackendError("the logprobs are not those of the sampled tokens")
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise BackendError(f"malformed generate response: {e!r}") from e
    versions, unchecked = versions_of(choice.get("weight_versions")) if ids else ([], None)
    return Generation(ids, logprobs, choice.get("finish_reason") or "stop", latency_ms,
                      {"stop_reason": choice.get("stop_reason")}, versions, unchecked)


def _from_completion(doc: dict, latency_ms: float) -> Generation:
    try:
        choice = doc["choices"][0]
        lp = choice["logprobs"]
        logprobs = [float(x) for x in lp["token_logprobs"]]
        ids = choice.get("token_ids")
        if ids is None:  # older servers: IDs only as "token_id:123" strings
            ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        ids = [int(t) for t in ids]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise BackendError(f"malformed completion response: {e!r}") from e
    if len(ids) != len(logprobs):
        raise BackendError(f"{len(ids)} token ids but {len(logprobs)} logprobs")
    return Generation(ids, logprobs, choice.get("finish_reason") or "stop", latency_ms,
                      {"stop_reason": choice.get("stop_reason")})
