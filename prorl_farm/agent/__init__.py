"""The agent side of RUN: chat templates rendered once, token-exact trajectories."""

from prorl_farm.agent.trajectory import ChatTokens, Trajectory, load_chat_tokens

__all__ = ["ChatTokens", "Trajectory", "load_chat_tokens"]
