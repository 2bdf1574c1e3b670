"""Clients for LLM inference servers, token IDs in and out."""

from prorl_farm.llm.backends.abstract import Generation, LLMClient
from prorl_farm.llm.backends.sglang import SGLangClient
from prorl_farm.llm.backends.vllm import VLLMClient

CLIENTS: dict[str, type[LLMClient]] = {"vllm": VLLMClient, "sglang": SGLangClient}


def client_for(kind: str, url: str, model: str, **kw) -> LLMClient:
    """A client for a backend of ``kind`` (``vllm`` or ``sglang``)."""
    try:
        cls = CLIENTS[kind]
    except KeyError:
        raise ValueError(f"unknown backend kind {kind!r}; expected {list(CLIENTS)}") from None
    return cls(url, model, **kw)


__all__ = ["CLIENTS", "Generation", "LLMClient", "SGLangClient", "VLLMClient", "client_for"]
