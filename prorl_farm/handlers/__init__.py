"""Handlers: what a job does in each stage."""

from prorl_farm.handlers.base import AgentHandler, JobContext
from prorl_farm.handlers.registry import HandlerRegistry

__all__ = ["AgentHandler", "HandlerRegistry", "JobContext"]
