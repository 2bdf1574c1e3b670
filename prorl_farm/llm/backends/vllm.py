"""vLLM's OpenAI-compatible ``/v1/completions`` with a token-ID prompt."""

from __future__ import annotations

import time

from prorl_farm.errors import BackendError
from prorl_farm.llm.backends.abstract import MAX_TOKENS, Generation, LLMClient, explicit_sampling

# Sampling fields passed through as vLLM names them.
PASS_THROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos")


class VLLMClient(LLMClient):
    kind = "vllm"

    def generate(self, prompt_ids: list[int], sampling: dict, abort_hook=None) -> Generation:
        body = {"model": self.model, "prompt": prompt_ids,
                "max_tokens": sampling.get("max_tokens", MAX_TOKENS),
                "logprobs": 0,  # the sampled token's logprob only
                "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False}
        sampling = explicit_sampling(sampling)
        body.update({k: sampling[k] for k in PASS_THROUGH if sampling.get(k) is not None})
        t0 = time.monotonic()
        doc = self.post_json("/v1/completions", body, abort_hook)
        latency_ms = 1000 * (time.monotonic() - t0)
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
