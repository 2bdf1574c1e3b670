"""The per-job model gateway: OpenAI- and Anthropic-style endpoints for agent harnesses,
with token-exact capture of every call (capture.py)."""
