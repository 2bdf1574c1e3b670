"""Clients for LLM inference servers, token IDs in and out."""

from prorl_farm.llm.clients.abstract import Generation, LLMClient, client_for

__all__ = ["Generation", "LLMClient", "client_for"]
