"""The LLMClient ABC: one generation from token IDs, with timeouts, bounded retries and
cancellation of the in-flight request."""

from __future__ import annotations

import atexit
import http.client
import json
import logging
import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prorl_farm import fastjson
from prorl_farm.errors import BackendError, BackendRequestError, FarmError, JobAborted
from prorl_farm.retry import with_retries

log = logging.getLogger(__name__)


# What the farm samples with where a request does not say: plain temperature sampling.
# Every request states every one of these, so an engine never fills one in from the model's
# generation_config.json (vLLM and SGLang both would: Qwen models ship top_k, top_p and a
# repetition penalty there) and a trainer never trains on samples from settings it did not
# ask for.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                     "repetition_penalty": 1.0, "presence_penalty": 0.0,
                     "frequency_penalty": 0.0, "ignore_eos": False}


# Tokens a turn generates at most where the request does not say.
MAX_TOKENS = 256


def explicit_sampling(sampling: dict) -> dict:
    """``sampling`` with every field of :data:`SAMPLING_DEFAULTS` stated."""
    return {**SAMPLING_DEFAULTS, **{k: v for k, v in sampling.items() if v is not None}}


@dataclass
class Generation:
    """What one request sampled: exactly the IDs and logprobs the server returned."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort" | ...
    latency_ms: float = 0.0
    raw_meta: dict = field(default_factory=dict)
    # The policy versions that sampled the tokens, as the engine reports them: (index of
    # the first token, version) at each change; empty where the engine does not say.
    versions: list[tuple[int, int]] = field(default_factory=list)
    # A version among ``versions`` whose weights were loaded in place and sampled before
    # the farm's check of them passed: the tokens count only once it has (the session
    # waits for the check's outcome; weights that fail it lose these tokens, never train).
    unchecked: int | None = None


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
        # One kept-alive connection, reused by the next request while the server keeps it;
        # handed to the process's idle pool on close, for the next job's client.
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            _IDLE.put(self._conn)
            self._conn = None

    @abstractmethod
    def generate(self, prompt_ids: list[int], sampling: dict, abort_hook=None) -> Generation:
        """Sample a continuation of ``prompt_ids``; raises BackendError, BackendRequestError,
        JobAborted."""

    def post_json(self, path: str, body: dict, abort_hook=None) -> dict:
        """POST with bounded retries on connection errors and 5xx; 4xx is not retried."""
        def said(attempt: int, e: BaseException) -> None:
            log.info("%s%s attempt %d failed: %s", self.url, path, attempt, e)

        try:
            return with_retries(lambda: self._post_once(path, body, abort_hook),
                                self.retries, self.retry_backoff_s,
                                retryable=lambda e: isinstance(e, BackendError), on_retry=said)
        except BackendError as e:
            said(self.retries + 1, e)
            raise BackendError(f"{self.url}{path}: {e}") from e

    def _connection(self, fresh: bool = False) -> tuple[http.client.HTTPConnection, bool]:
        """(connection, reused): the kept-alive one, an idle one of this process to the same
        server, or (``fresh``, or none idle) a new one."""
        conn, self._conn = self._conn, None
        if conn is None and not fresh:
            conn = _IDLE.take(self.scheme, self.host, self.port)
        if conn is not None and conn.sock is not None and not fresh:
            conn.sock.settimeout(self.timeout_s)
            return conn, True
        if conn is not None:
            conn.close()
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s), False
        return PlainConnection(self.host, self.port, timeout=self.timeout_s), False

    def _post_once(self, path: str, body: dict, abort_hook) -> dict:
        data = fastjson.dumps(body)
        conn, reused = self._connection()
        if reused:
            try:
                return self._exchange(conn, path, data, abort_hook)
            except _StaleConnection:
                # The server closed it meanwhile: once more, on a new connection.
                conn, _ = self._connection(fresh=True)
        try:
            return self._exchange(conn, path, data, abort_hook)
        except _StaleConnection as e:
            cause = e.__cause__
            raise BackendError(f"{type(cause).__name__}: {cause}") from cause

    def _exchange(self, conn: http.client.HTTPConnection, path: str, data: bytes,
                  abort_hook) -> dict:
        aborted = False
        keep = False
        sent = False

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
            if conn.sock is None:
                conn.connect()
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.request("POST", self.base_path + path, body=data, headers=self.headers)
            sent = True
            resp = conn.getresponse()
            payload = resp.read()
            keep = not resp.will_close and not aborted
        except (OSError, http.client.HTTPException) as e:
            if aborted:
                raise JobAborted("request aborted") from e
            if (not sent or isinstance(e, (http.client.RemoteDisconnected,
                                           ConnectionResetError, BrokenPipeError))):
                # Nothing was answered on this connection: a kept-alive one the server
                # had closed (the caller retries once on a new one), or a refused connect.
                raise _StaleConnection() from e
            raise BackendError(f"{type(e).__name__}: {e}") from e
        finally:
            if remove:
                remove()
            if keep:
                self._conn = conn
            else:
                conn.close()
        if aborted:
            raise JobAborted("request aborted")
        if resp.status >= 500:
            raise BackendError(f"HTTP {resp.status}: {payload[:300]!r}")
        if resp.status == 404:  # a route this server does not have: asking again won't help
            raise BackendRequestError(f"HTTP 404: {payload[:300]!r}")
        try:
            doc = fastjson.loads(payload)
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


class _IdleConnections:
    """Kept-alive connections no client holds, per server, so that a job's first request
    does not open a connection (and, on many servers, start a thread) of its own: single-turn
    jobs would otherwise pay a TCP handshake each. One taken after the server dropped it is
    retried on a new connection; those idle longer than ``MAX_IDLE_S`` (below common
    keep-alive timeouts: uvicorn's is 5 s) are closed instead of reused."""

    MAX_IDLE_S = 3.0
    MAX_PER_SERVER = 256

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: dict[tuple, list] = {}
        self._pid = os.getpid()

    def _mine(self) -> dict:
        if self._pid != os.getpid():  # a forked child must not share its parent's sockets
            self._idle, self._pid = {}, os.getpid()
        return self._idle

    def put(self, conn: http.client.HTTPConnection) -> None:
        if conn.sock is None:
            return
        key = (type(conn).__name__, conn.host, conn.port)
        with self._lock:
            idle = self._mine().setdefault(key, [])
            if len(idle) < self.MAX_PER_SERVER:
                idle.append((time.monotonic(), conn))
                return
        conn.close()

    def take(self, scheme: str, host: str, port: int) -> http.client.HTTPConnection | None:
        key = ("HTTPSConnection" if scheme == "https" else "PlainConnection", host, port)
        with self._lock:
            idle = self._mine().get(key, [])
            now = time.monotonic()
            old = [c for since, c in idle if now - since > self.MAX_IDLE_S]
            idle[:] = [(since, c) for since, c in idle if now - since <= self.MAX_IDLE_S]
            conn = idle.pop()[1] if idle else None  # the most recently used: least likely dropped
        for c in old:
            c.close()
        return conn

    def close_all(self) -> None:
        with self._lock:
            idle, self._idle = self._mine(), {}
        for conns in idle.values():
            for _, c in conns:
                c.close()


_IDLE = _IdleConnections()
atexit.register(_IDLE.close_all)


class _Response:
    """What :meth:`PlainConnection.getresponse` answers: as much of ``http.client``'s
    response as the client reads."""

    __slots__ = ("status", "will_close", "_body")

    def __init__(self, status: int, will_close: bool, body: bytes):
        self.status, self.will_close, self._body = status, will_close, body

    def read(self) -> bytes:
        return self._body


class PlainConnection:
    """A kept-alive HTTP/1.1 connection to a backend, without ``http.client``'s header
    parsing (the standard library's e-mail parser, most of a short request's cost in a busy
    gateway process): the request goes out in one write; the answer is read by its status
    line, its headers (at most 100), and its body by ``Content-Length``, chunks, or up to
    the close. Raises what ``http.client`` raises for the same faults (``RemoteDisconnected``
    when nothing was answered, ``IncompleteRead``, ``LineTooLong``, ``BadStatusLine``), so
    the client's handling of a dropped connection is one for both. Kept for speed:
    ``bench/gateway.py`` (bench/RESULTS.md, the "gateway" section of 2026-12-04):
    ``http.client``'s header parsing was a sixth of a busy gateway's time; flat out, one
    RUN process went from 702-918 to 1,017-1,301 calls/s with this and its companions."""

    MAX_LINE, MAX_HEADERS = 65536, 100

    def __init__(self, host: str, port: int, timeout: float | None = None):
        self.host, self.port, self.timeout = host, port, timeout
        self.sock: socket.socket | None = None
        self._rfile = None

    def connect(self) -> None:
        self.sock = socket.create_connection((self.host, self.port), self.timeout)
        self._rfile = self.sock.makefile("rb")

    def close(self) -> None:
        sock, rfile, self.sock, self._rfile = self.sock, self._rfile, None, None
        if rfile is not None:
            rfile.close()
        if sock is not None:
            sock.close()

    def request(self, method: str, url: str, body: bytes, headers: dict) -> None:
        if self.sock is None:
            self.connect()
        host = self.host if self.port == 80 else f"{self.host}:{self.port}"
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.sock.sendall(f"{method} {url} HTTP/1.1\r\nHost: {host}\r\n{head}"
                          f"Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body)

    def _line(self) -> bytes:
        line = self._rfile.readline(self.MAX_LINE + 1)
        if len(line) > self.MAX_LINE:
            raise http.client.LineTooLong("header line")
        return line

    def getresponse(self) -> _Response:
        while True:
            line = self._line()
            if not line:
                raise http.client.RemoteDisconnected("Remote end closed connection without "
                                                     "response")
            parts = line.split(None, 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                raise http.client.BadStatusLine(repr(line))
            status = int(parts[1])
            headers: dict[bytes, bytes] = {}
            for _ in range(self.MAX_HEADERS + 1):
                raw = self._line()
                if raw in (b"\r\n", b"\n", b""):
                    break
                name, _, value = raw.partition(b":")
                headers[name.strip().lower()] = value.strip()
            else:
                raise http.client.HTTPException(f"more than {self.MAX_HEADERS} headers")
            if status >= 200:
                break  # a 1xx (100 Continue) is followed by the answer
        will_close = headers.get(b"connection", b"").lower() == b"close" or \
            parts[0] == b"HTTP/1.0" and headers.get(b"connection", b"").lower() != b"keep-alive"
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            return _Response(status, will_close, self._chunks())
        length = headers.get(b"content-length")
        if length is None:
            if status in (204, 304):
                return _Response(status, will_close, b"")
            return _Response(status, True, self._rfile.read())
        try:
            n = int(length)
        except ValueError:
            raise http.client.HTTPException(f"Content-Length: {length!r}") from None
        body = self._rfile.read(n)
        if len(body) < n:
            raise http.client.IncompleteRead(body, n - len(body))
        return _Response(status, will_close, body)

    def _chunks(self) -> bytes:
        out = []
        while True:
            line = self._line()
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise http.client.IncompleteRead(b"".join(out)) from None
            if size == 0:
                while self._line() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(out)
            chunk = self._rfile.read(size + 2)
            if len(chunk) < size + 2:
                raise http.client.IncompleteRead(b"".join(out) + chunk[:size], size)
            out.append(chunk[:size])


class _StaleConnection(FarmError):
    """A request that got no answer because its connection was gone before it started."""
