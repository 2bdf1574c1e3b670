"""SGLang's native ``/generate`` with ``input_ids``."""

from __future__ import annotations

import time

from prorl_farm.errors import BackendError
from prorl_farm.llm.backends.abstract import MAX_TOKENS, Generation, LLMClient, explicit_sampling

PASS_THROUGH = ("temperature", "top_p", "top_k", "min_p", "stop_token_ids",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos")


class SGLangClient(LLMClient):
    kind = "sglang"

    def generate(self, prompt_ids: list[int], sampling: dict, abort_hook=None) -> Generation:
        sampling = explicit_sampling(sampling)
        params = {"max_new_tokens": sampling.get("max_tokens", MAX_TOKENS),
                  "skip_special_tokens": False}
        params.update({k: sampling[k] for k in PASS_THROUGH if sampling.get(k) is not None})
        if sampling.get("seed") is not None:
            params["sampling_seed"] = sampling["seed"]
        body = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True,
                "logprob_start_len": -1, "stream": False}
        t0 = time.monotonic()
        doc = self.post_json("/generate", body, abort_hook)
        latency_ms = 1000 * (time.monotonic() - t0)
        try:
            meta = doc["meta_info"]
            rows = meta["output_token_logprobs"]
            ids = [int(row[1]) for row in rows]
            logprobs = [float(row[0]) for row in rows]
            finish = meta.get("finish_reason")
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise BackendError(f"malformed generate response: {e!r}") from e
        if doc.get("output_ids") is not None and [int(t) for t in doc["output_ids"]] != ids:
            raise BackendError("output_ids and output_token_logprobs disagree")
        if isinstance(finish, dict):
            finish = finish.get("type")
        return Generation(ids, logprobs, finish or "stop", latency_ms, {"meta": meta})
