"""The tools the in-sandbox server offers: bash on a pty, IPython, file editing."""

from prorl_farm.errors import ToolError

__all__ = ["ToolError"]
