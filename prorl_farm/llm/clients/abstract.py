"""The LLMClient ABC: one generation from token IDs, with timeouts, bounded retries and
cancellation of the in-flight request."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prorl_farm.errors import BackendError, BackendRequestError, JobAborted

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """What one request sampled: exactly the IDs and logprobs the server returned."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort" | ...
    latency_ms: float = 0.0
    raw_meta: dict = field(default_factory=dict)


class LLMClient(ABC):
    """Talks to one backend. ``abort_hook(callback) -> remove`` lets the caller interrupt the
    in-flight request (the job's JobContext.on_abort)."""

    kind: str = ""

    def __init__(self, url: str, model: str, timeout_s: float = 600.0, retries: int = 2,
                 retry_backoff_s: float = 0.5, headers: dict | None = None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"backend url must be http(s)://host[:port], got {url!r}")
        self.url = url.rstrip("/")
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base_path = parts.path.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        # Extra request headers, e.g. X-Prorl-Job to trace a job's requests in server logs.
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    @abstractmethod
    def generate(self, prompt_ids: list[int], sampling: dict, abort_hook=None) -> Generation:
        """Sample a continuation of ``prompt_ids``; raises BackendError, BackendRequestError,
        JobAborted."""

    def post_json(self, path: str, body: dict, abort_hook=None) -> dict:
        """POST with bounded retries on connection errors and 5xx; 4xx is not retried."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                return self._post_once(path, body, abort_hook)
            except BackendError as e:
                last = e
                log.info("%s%s attempt %d failed: %s", self.url, path, attempt + 1, e)
        raise BackendError(f"{self.url}{path}: {last}") from last

    def _post_once(self, path: str, body: dict, abort_hook) -> dict:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout_s)
        aborted = False

        def interrupt() -> None:
            nonlocal aborted
            aborted = True
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read at once
                except OSError:
                    pass

        remove = abort_hook(interrupt) if abort_hook else None
        try:
            data = json.dumps(body).encode()
            conn.request("POST", self.base_path + path, body=data, headers=self.headers)
            resp = conn.getresponse()
            payload = resp.read()
        except (OSError, http.client.HTTPException) as e:
            if aborted:
                raise JobAborted("request aborted") from e
            raise BackendError(f"{type(e).__name__}: {e}") from e
        finally:
            if remove:
                remove()
            conn.close()
        if aborted:
            raise JobAborted("request aborted")
        if resp.status >= 500:
            raise BackendError(f"HTTP {resp.status}: {payload[:300]!r}")
        try:
            doc = json.loads(payload)
        except ValueError as e:
            raise BackendError(f"HTTP {resp.status}: not JSON: {payload[:200]!r}") from e
        if resp.status >= 400:
            raise BackendRequestError(f"HTTP {resp.status}: {_message(doc)}")
        return doc


def _message(doc) -> str:
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if doc.get("message"):
            return str(doc["message"])
    return json.dumps(doc)[:300]
