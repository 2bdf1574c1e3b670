"""The tools the in-sandbox server offers: bash on a pty, IPython, file editing."""


class ToolError(Exception):
    """A tool call the tool itself rejects (bad path, ambiguous edit, ...): reported to the
    caller as an error reply, never fatal to the server."""
