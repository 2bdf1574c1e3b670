"""The EVAL pool."""
