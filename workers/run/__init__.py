"""The RUN pool."""
