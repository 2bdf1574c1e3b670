"""prorl-farm: a rollout farm for reinforcement learning of multi-turn LLM agents."""

__version__ = "0.1.0"
