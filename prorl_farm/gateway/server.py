"""The gateway's HTTP side: one server per pool process, one key per job.

``GatewayServer`` serves ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/responses`` (OpenAI) and ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (Anthropic; any query, such as ``?beta=true``, and any
``anthropic-beta`` header are let be) to whoever
holds a job's key (``Authorization: Bearer <key>``, or ``x-api-key``); a key is the job's
own, and dead once :meth:`GatewayServer.close_job` ran (401, in OpenAI's error shape).
Each call of a job is turned into prompt ids by its :class:`~prorl_farm.gateway.capture.
Capture`, sampled token-in/token-out by the job's ``sampler`` (in the farm: its sticky
backend session, under the job's deadline and cancellation), and answered from the sampled
ids. Calls of one job run one at a time (a harness's calls are one conversation).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socketserver
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prorl_farm import fastjson
from prorl_farm.errors import BackendUnavailable
from prorl_farm.gateway.anthropic_api import (
    error_body,
    messages_response,
    messages_stream,
    parse_count,
    parse_messages,
)
from prorl_farm.gateway.capture import Capture, ContextFull
from prorl_farm.gateway.openai_api import (
    GatewayError,
    chat_response,
    chat_stream,
    merge_sampling,
    parse_chat,
)
from prorl_farm.gateway.responses_api import (
    parse_responses,
    reply_messages,
    response_object,
    responses_stream,
)
from prorl_farm.llm.backends.abstract import Generation

log = logging.getLogger(__name__)
MAX_BODY = 16 << 20
MAX_LINE, MAX_HEADERS = 65536, 100
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
            404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large",
            429: "Too Many Requests", 500: "Internal Server Error",
            503: "Service Unavailable", 529: "Overloaded"}


class _Headers(dict):
    """A request's headers by lower-cased name; ``get`` takes any case."""

    def get(self, name: str, default=None):
        return dict.get(self, name.lower(), default)


@dataclass
class Sampled:
    """One call's generation and the backend that made it."""

    generation: Generation
    backend: str
    policy_version: int
    logprobs_mode: str
    versions: list[tuple[int, int]] | None = None  # as llm.session.Turn.versions


# Calls of one job waiting for their turn at once, past which a call gets 429 (a harness
# flooding its gateway does not pile up threads).
MAX_PENDING_CALLS = 8
# Responses a job keeps for ``previous_response_id`` (the newest).
KEPT_RESPONSES = 64
# What a call refused for want of capacity (429, 529) tells the client to wait, seconds.
RETRY_AFTER_S = 2


@dataclass
class JobGateway:
    """What the gateway knows of one job: its capture, its sampler, and its episode's
    limits. A limit reached (calls, generated tokens, the context) *ends the episode*: that
    call and every later one are refused (400 ``episode_over``) and ``on_end`` hears the
    reason once (in the farm: RUN stops the harness and goes on to EVAL)."""

    job_id: str
    capture: Capture
    sampler: Callable[[list[int], dict], Sampled]
    sampling: dict  # the job's (the trainer's): it wins over a harness's own values
    model: str
    max_tokens: int  # per call, at most
    max_calls: int = 0  # calls sampled, at most (0: no limit)
    max_total_tokens: int = 0  # generated over the episode, at most (0: no limit)
    on_end: Callable[[str], None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    overrides: list[dict] = field(default_factory=list)
    sampled: int = 0
    generated: int = 0
    ended: str = ""
    _pending: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(MAX_PENDING_CALLS))
    _responses: dict[str, list[dict]] = field(default_factory=dict)

    def chat(self, body) -> tuple[dict | None, object]:
        """OpenAI Chat Completions: (JSON answer, or None and an event stream)."""
        req = parse_chat(body)
        reply, prompt_len = self._call(req)
        if req.stream:
            return None, chat_stream(req, reply, prompt_len, self.model)
        return chat_response(req, reply, prompt_len, self.model), None

    def messages(self, body) -> tuple[dict | None, object]:
        """Anthropic Messages: (JSON answer, or None and an event stream)."""
        req = parse_messages(body)
        reply, prompt_len = self._call(req)
        if req.stream:
            return None, messages_stream(reply, prompt_len, self.model, req)
        return messages_response(reply, prompt_len, self.model, req), None

    def count_tokens(self, body) -> tuple[dict, None]:
        """Anthropic ``count_tokens``: the prompt's length as this job's template renders
        it (nothing sampled, nothing captured)."""
        req = parse_count(body)
        with self.lock:
            return {"input_tokens": self.capture.count(req.messages, req.tools)}, None

    def responses(self, body) -> tuple[dict | None, object]:
        """OpenAI Responses: (JSON answer, or None and an event stream)."""
        req = parse_responses(body, self._responses)
        reply, prompt_len = self._call(req)
        doc = response_object(req, reply, prompt_len, self.model, f"resp_{uuid.uuid4().hex}")
        self._responses[doc["id"]] = req.messages + reply_messages(doc)
        while len(self._responses) > KEPT_RESPONSES:
            self._responses.pop(next(iter(self._responses)))
        if req.stream:
            return None, responses_stream(doc)
        return doc, None

    def end(self, reason: str) -> None:
        """End the episode (once): no call is served after this."""
        if self.ended:
            return
        self.ended = reason
        if self.on_end is not None:
            self.on_end(reason)

    def _over(self, reason: str) -> GatewayError:
        self.end(reason)
        return GatewayError(400, f"the episode is over ({self.ended}): this job's model "
                            "calls are done", code="episode_over")

    def _call(self, req) -> tuple:
        """One call: its prompt ids (the capture), the sample, the reply."""
        if not self._pending.acquire(blocking=False):
            raise GatewayError(429, f"more than {MAX_PENDING_CALLS} calls of this job at once"
                               "; a job's calls are one conversation, served one at a time",
                               kind="rate_limit_error", code="rate_limit_exceeded",
                               retry_after=RETRY_AFTER_S)
        try:
            with self.lock:
                return self._sample(req)
        finally:
            self._pending.release()

    def _sample(self, req) -> tuple:
        if self.ended:
            raise self._over(self.ended)
        if self.max_calls and self.sampled >= self.max_calls:
            raise self._over("max_turns")
        budget = self.max_tokens
        if self.max_total_tokens:
            budget = min(budget, self.max_total_tokens - self.generated)
            if budget <= 0:
                raise self._over("max_tokens")
        try:
            prompt = self.capture.prompt(req.messages, req.tools)
        except ContextFull as e:
            if self.sampled:  # the conversation outgrew the context: as the loop's "context"
                self.end("context")
            raise GatewayError(400, str(e), "messages", code="context_length_exceeded"
                               ) from e
        if self.capture.context_length:
            budget = min(budget, self.capture.context_length - len(prompt))
        sampling, overridden = merge_sampling(self.sampling, req.sampling, budget)
        try:
            out = self.sampler(prompt, sampling)
        except BackendUnavailable as e:  # saturated: the client may come back for it
            self.capture.rollback()
            raise GatewayError(529, f"the policy's backends are saturated: {e}",
                               kind="overloaded_error", code="overloaded",
                               retry_after=RETRY_AFTER_S) from e
        except BaseException:
            self.capture.rollback()
            raise
        self.overrides += overridden
        gen = out.generation
        reply = self.capture.record(prompt, gen.token_ids, gen.logprobs, gen.finish_reason,
                                    out.backend, out.policy_version, out.logprobs_mode,
                                    out.versions)
        self.sampled += 1
        self.generated += len(gen.token_ids)
        return reply, len(prompt)

    def result(self) -> dict:
        with self.lock:  # a call in flight finishes first
            out = self.capture.result()
        out["capture"]["sampling_overrides"] = self.overrides
        return out


class _Handler(BaseHTTPRequestHandler):
    server: GatewayServer
    protocol_version = "HTTP/1.1"
    # Headers and body go out as separate writes: without TCP_NODELAY, Nagle's algorithm
    # and the client's delayed ACK hold the body back about 40 ms a call.
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):  # noqa: D401 - quiet: the farm logs what matters
        log.debug("gateway: " + fmt, *args)

    def _job(self) -> JobGateway:
        auth = self.headers.get("Authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else \
            self.headers.get("x-api-key", "")
        job = self.server.jobs.get(key) if key else None
        if job is None:
            raise GatewayError(401, "invalid API key (this gateway serves the key of a job "
                               "that is running)", kind="invalid_request_error",
                               code="invalid_api_key")
        return job

    def _send(self, status: int, doc: dict, headers: dict | None = None) -> None:
        data = fastjson.dumps(doc)
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        if self.close_connection:
            extra += "Connection: close\r\n"
        self.wfile.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                         f"{extra}\r\n".encode() + data)

    def _stream(self, events) -> None:
        # The reply is whole before the first event: the events go out in one write.
        out = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"]
        for event in events:
            out.append(f"{len(event):x}\r\n".encode() + event + b"\r\n")
        out.append(b"0\r\n\r\n")
        self.wfile.write(b"".join(out))

    def handle_one_request(self) -> None:
        """One request, read without the standard library's e-mail header parser (most of
        a call's cost in a busy gateway): the request line, at most 100 headers, the body
        by its Content-Length; the answer written in one piece. Kept for speed:
        ``bench/gateway.py`` (bench/RESULTS.md, "gateway, at scale: HTTP reworked"),
        453 -> 588-620 calls/s at 512 episodes in flight, added p50 40 -> 11-28 ms."""
        line = self.rfile.readline(MAX_LINE + 1)
        if not line:
            self.close_connection = True
            return
        parts = line.decode("latin-1").split()
        headers = _Headers()
        for _ in range(MAX_HEADERS + 1):
            raw = self.rfile.readline(MAX_LINE + 1)
            if raw in (b"\r\n", b"\n", b""):
                break
            name, sep, value = raw.decode("latin-1").partition(":")
            if not sep or len(raw) > MAX_LINE:
                parts = []
                break
            headers[name.strip().lower()] = value.strip()
        else:
            parts = []
        if len(line) > MAX_LINE or len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self.close_connection = True
            self._send(400, {"error": {"message": "a malformed HTTP request",
                                       "type": "invalid_request_error"}})
            return
        self.command, self.path, self.request_version = parts
        self.headers = headers
        self._body_read = False
        connection = headers.get("connection", "").lower()
        self.close_connection = connection == "close" or (
            self.request_version == "HTTP/1.0" and connection != "keep-alive")
        if headers.get("expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.command in ("GET", "POST"):
            self._serve(self.command)
        else:
            self.close_connection = True
            self._send(405, {"error": {"message": f"method {self.command} is not served",
                                       "type": "invalid_request_error"}})

    def _body(self):
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            raise GatewayError(400, "Content-Length: not a length")
        if length > MAX_BODY:
            self.close_connection = True  # its body is not read
            raise GatewayError(413, f"the request body is over {MAX_BODY} bytes")
        raw = self.rfile.read(length)
        self._body_read = True
        try:
            return fastjson.loads(raw or b"null")
        except ValueError as e:
            raise GatewayError(400, f"the request body is not JSON: {e}") from e

    def _serve(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            job = self._job()
            if method == "GET" and path == "/v1/models":
                self._send(200, {"object": "list", "data": [{
                    "id": job.model, "object": "model", "created": 0, "owned_by": "prorl-farm"}]})
                return
            calls = {"/v1/chat/completions": job.chat, "/v1/messages": job.messages,
                     "/v1/responses": job.responses,
                     "/v1/messages/count_tokens": job.count_tokens}
            if method == "POST" and path in calls:
                call = calls[path]
                doc, events = call(self._body())
                if events is not None:
                    self._stream(events)
                else:
                    self._send(200, doc)
                return
            raise GatewayError(404, f"no route {method} {path}", kind="not_found_error")
        except Exception as e:  # noqa: BLE001 - the harness hears of it; the job goes on
            if not self._body_read and self.headers.get("content-length", "0") != "0":
                self.close_connection = True  # its body was not read: the stream is lost
            if not isinstance(e, GatewayError):
                log.warning("gateway call failed: %s", e, exc_info=True)
                e = GatewayError(500, f"{type(e).__name__}: {e}", kind="server_error")
            headers = {} if e.retry_after is None else {"retry-after": str(e.retry_after)}
            if path.startswith("/v1/messages"):
                request_id = f"req_{uuid.uuid4().hex[:24]}"
                self._send(e.status, error_body(e, request_id),
                           {**headers, "request-id": request_id})
            else:  # Anthropic's "overloaded" is OpenAI's 503
                self._send(503 if e.status == 529 else e.status, e.body(), headers)


def new_key() -> str:
    """A job's gateway key: random, unguessable."""
    return f"prorl-{secrets.token_urlsafe(24)}"


class _Serving:
    """The jobs a gateway server serves, by key, and its serving thread."""

    jobs: dict[str, JobGateway]

    def _start(self) -> None:
        self.jobs = {}
        self._thread = threading.Thread(target=self.serve_forever, name="prorl-gateway",
                                        daemon=True)
        self._thread.start()

    def open_job(self, job: JobGateway, key: str | None = None) -> str:
        """Serve ``job`` under ``key`` (default: a new random one); returns the key."""
        key = key or new_key()
        self.jobs[key] = job
        return key

    def close_job(self, key: str) -> JobGateway | None:
        """The job's key is dead from now on; returns what it captured."""
        return self.jobs.pop(key, None)

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


class GatewayServer(_Serving, ThreadingHTTPServer):
    """The model endpoint of this process's jobs on a TCP address (loopback by default)."""

    daemon_threads = True
    request_queue_size = 1024  # many harnesses connect at once

    def __init__(self, address=("127.0.0.1", 0)):
        ThreadingHTTPServer.__init__(self, address, _Handler)
        self._start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _UnixHandler(_Handler):
    disable_nagle_algorithm = False  # not a TCP socket

    def address_string(self) -> str:
        return "sandbox"


class UnixGatewayServer(_Serving, socketserver.ThreadingUnixStreamServer):
    """The model endpoint on a Unix socket: what a sandbox's relay reaches (the socket in
    the sandbox's gateway directory, sandbox.abstract.gateway_dir). The socket is open to
    any local user (the sandbox runs as another); the job's key is what admits a call.

    The directory is the sandbox's to write: the socket is bound and opened to all in a
    private directory beside it, then renamed into place over whatever is there. Bound in
    place, a link the sandbox put there between the bind and the chmod would have the chmod
    open the link's target (a host file) to every user."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, path: str):
        staging = tempfile.mkdtemp(prefix=".gw-", dir=os.path.dirname(os.path.dirname(path)))
        bound = os.path.join(staging, os.path.basename(path))
        try:
            socketserver.ThreadingUnixStreamServer.__init__(self, bound, _UnixHandler)
            try:
                os.chmod(bound, 0o666)
                os.rename(bound, path)
            except BaseException:
                self.server_close()
                raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(bound)
            os.rmdir(staging)
        self.path = path
        self._start()

    def stop(self) -> None:
        super().stop()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
