"""The API's HTTP server: gunicorn's processes, each one event loop that reads every request
whole before a thread runs it.

gunicorn's threaded worker hands a connection to a thread as soon as its first bytes
arrive, and the thread reads the rest: 40 connections that send half their headers (or
half a body) held 40 threads, and every other caller's request timed out behind them
(docs/security.md, "Threads are shared"). Here a request is read by the event loop
(tornado's HTTP server, under gunicorn's tornado worker: its processes, heartbeats and
graceful stop), with deadlines for its headers and its body and the API's body limit, and
only a request read in full takes one of ``PRORL_API_THREADS`` threads to run the Flask
app; its answer is written back by the loop. A slow sender or a slow reader costs a socket,
never a thread. What one tenant's requests may hold of the threads at once (long-polls
above all) is bounded (:class:`Bounds`): past it, 429, answered without a thread.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import tornado.httpserver
from gunicorn.workers.gtornado import TornadoWorker
from tornado import httputil
from tornado.ioloop import IOLoop, PeriodicCallback
from tornado.wsgi import WSGIContainer

from prorl_farm.config import Settings, load_settings
from prorl_farm.tenants import any_key, identify, parse_tenants

# Seconds a connection may take to send a request's headers (and stay idle between kept
# alive requests), and to send its body.
HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 120.0


# A long-poll: a results read that may wait (the one-batch read with ``wait`` above 0; the
# several-batch read, which trainers use to wait).
_ONE_BATCH_RESULTS = re.compile(r"^/v1/batches/[^/]+/results$")
_WAIT = re.compile(r"(?:^|&)wait=([0-9.eE+-]+)")


def long_poll(method: str, path: str, query: str) -> bool:
    if method == "POST" and path == "/v1/batches/results":
        return True
    if method != "GET" or not _ONE_BATCH_RESULTS.match(path):
        return False
    m = _WAIT.search(query)
    try:
        return bool(m) and float(m.group(1)) > 0
    except ValueError:
        return False


class Bounds:
    """What one caller's requests may hold of a process's threads at once: a tenant's key
    (or, without a key the farm knows, an address) at most half of them, and at most a
    quarter in long-polls; past that its request is answered 429 (``Retry-After: 1``) by the
    event loop, without a thread, while the others are served. The operator's requests
    (and every request of a farm without keys: one party) are not bounded."""

    def __init__(self, settings: Settings):
        self.api_token = settings.api_token
        self.tenants = parse_tenants(settings.tenants)
        self.keyed = any_key(settings.api_token, self.tenants)
        self.max_requests = max(1, settings.api_threads // 2)
        self.max_long_polls = max(1, settings.api_threads // 4)
        self.held: dict[str, int] = {}
        self.polls: dict[str, int] = {}

    def caller(self, request: httputil.HTTPServerRequest) -> str | None:
        """Whom ``request``'s hold counts to; None: not bounded."""
        if not self.keyed:
            return None
        operator, tenant = identify(request.headers.get("Authorization"), self.api_token,
                                    self.tenants)
        if operator:
            return None
        return f"tenant:{tenant.name}" if tenant else f"addr:{request.remote_ip}"

    def refusal(self, who: str, polls: bool) -> str | None:
        if self.held.get(who, 0) >= self.max_requests:
            return f"at most {self.max_requests} requests of one key run at once here"
        if polls and self.polls.get(who, 0) >= self.max_long_polls:
            return f"at most {self.max_long_polls} long-polls of one key wait at once here"
        return None

    def take(self, who: str, polls: bool, n: int) -> None:
        self.held[who] = self.held.get(who, 0) + n
        if polls:
            self.polls[who] = self.polls.get(who, 0) + n
        for table in (self.held, self.polls):
            if table.get(who) == 0:
                del table[who]


class BoundedContainer(WSGIContainer):
    """The Flask app on the worker's threads, each caller within its :class:`Bounds`
    (counted on the event loop: no lock, no thread spent on a refusal)."""

    def __init__(self, app, executor, bounds: Bounds):
        super().__init__(app, executor=executor)
        self.bounds = bounds

    async def handle_request(self, request: httputil.HTTPServerRequest) -> None:
        who = self.bounds.caller(request)
        if who is None:
            return await super().handle_request(request)
        polls = long_poll(request.method or "", request.path, request.query)
        why = self.bounds.refusal(who, polls)
        if why is not None:
            return self._refuse(request, why)
        self.bounds.take(who, polls, 1)
        try:
            return await super().handle_request(request)
        finally:
            self.bounds.take(who, polls, -1)

    @staticmethod
    def _refuse(request: httputil.HTTPServerRequest, why: str) -> None:
        body = json.dumps({"error": {"code": "too_many_requests", "message": f"{why}; "
                                     "retry", "details": {}}}).encode()
        headers = httputil.HTTPHeaders({"Content-Type": "application/json",
                                        "Content-Length": str(len(body)),
                                        "Retry-After": "1"})
        request.connection.write_headers(
            httputil.ResponseStartLine("HTTP/1.1", 429, "Too Many Requests"), headers,
            chunk=body)
        request.connection.finish()


class Worker(TornadoWorker):
    """gunicorn's tornado worker, running the Flask app on a pool of threads
    (``PRORL_API_THREADS``) behind an HTTP server with read deadlines and the body limit."""

    def run(self):
        # TornadoWorker.run, but for the server it makes: gunicorn's builds a bare
        # WSGIContainer (the app on the event loop) and an HTTPServer with no limits, and
        # offers no hook to change either.
        settings = load_settings()
        self.ioloop = IOLoop.current()
        self.alive, self.server_alive = True, False
        self.callbacks = [PeriodicCallback(self.watchdog, 1000),
                          PeriodicCallback(self.heartbeat, 1000)]
        for callback in self.callbacks:
            callback.start()
        app = BoundedContainer(self.wsgi, ThreadPoolExecutor(
            settings.api_threads, thread_name_prefix="api"), Bounds(settings))
        worker = self

        class _HTTPServer(tornado.httpserver.HTTPServer):
            def on_close(self, server_conn):
                worker.handle_request()
                super().on_close(server_conn)

        self.server = _HTTPServer(
            app, idle_connection_timeout=HEADER_TIMEOUT_S, body_timeout=BODY_TIMEOUT_S,
            max_body_size=settings.max_body_bytes + 65536, max_header_size=65536)
        self.server_alive = True
        for s in self.sockets:
            s.setblocking(False)
            self.server.add_socket(s)
        self.server.no_keep_alive = self.cfg.keepalive <= 0
        self.ioloop.start()
