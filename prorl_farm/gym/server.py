"""The farm as a NeMo Gym agent server (``prorl-farm gym``; ``prorl-farm up`` starts it).

Gym's rollout collection (``ng_collect_rollouts``, NeMo RL's ``NemoGym`` environment)
POSTs each data row to an agent server's ``/run`` and waits for the row back with its
``response`` and ``reward``. This server answers ``/run`` by running the row as a farm job
(gym/rows.py says which), through the farm's own HTTP API: rows that arrive within 25 ms
of each other with the same task type and sampling go out in one ``POST /v1/jobs``, all
into the server's current farm batch; every row in flight waits on one long-poll of that
batch's results (``POST /v1/batches/results``). A row waiting holds no thread and no
worker, only its open request (tornado, one event loop). (Measured, bench/gym.py: one
submit per row and a long-poll per submit's batch cost a third more than the farm's API at
the same concurrency; coalesced, one batch, one poll: within a few percent.)

Routes: ``POST /run``, ``POST /aggregate_metrics``, ``POST /v1/responses`` (the episode
of a Responses create body, as a ``chat`` job: its response, no reward),
``POST /v1/agent_sessions`` and ``POST /v1/agent_sessions/close`` (Gym's session protocol:
sessions are remembered, the farm needs none), ``GET /healthz``. A row the farm cannot take
is answered 200 as Gym's agents answer a rollout that did not happen (rows.refused: a
failure record, which Gym's collector sets aside in its failures file and goes on; the
fields named as FastAPI's 422 ``detail`` would), and nothing is enqueued for it: one bad
row among many fails alone. A failed job comes back 200, masked or as a failure record
(rows.run_answer). Only a body that is not JSON is a 400, and a farm that cannot be reached
a 502 (Gym's "the rollout did not run").

Keys: on a farm with keys every route but the probes needs one (a tenant's or the
operator's, ``Authorization: Bearer``), and a caller's rows go to the API with its own key,
as its tenant, under its quotas and fair share; the server holds no key of its own, and
each caller's batches, polls and agent sessions are its own. A refusal of the caller (401,
403, 429 over a quota) is answered with the API's status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterable

from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from tornado.httpserver import HTTPServer
from tornado.web import Application, HTTPError, RequestHandler

from prorl_farm.access import is_loopback, token_ok
from prorl_farm.errors import ConfigError, FarmError
from prorl_farm.gym.rows import (
    RowError,
    Submission,
    aggregate,
    parse_servers,
    refused,
    response_object,
    run_answer,
    to_submission,
)
from prorl_farm.retry import backoff_s
from prorl_farm.tenants import any_key, identify

log = logging.getLogger(__name__)

BATCH_WINDOW_S = 0.025  # rows arriving this close together go out in one submit
BATCH_JOBS = 4096  # jobs per farm batch the server fills
EARLY_KEEP_S = 600.0
MAX_BATCH = 512  # rows per submit, at most
POLL_WAIT_S = 1.0  # the results long-poll's wait
MAX_POLLS = 1  # long-polls in flight at once (each holds an API thread while it waits)
RETRY_S, RETRY_MAX_S = 0.2, 5.0  # pauses after a failed call to the farm's API
SESSION_KEEP_S = 300.0  # closed sessions remembered (Gym's retry window)


class FarmUnavailable(FarmError, RuntimeError):
    """The farm's API refused or could not be reached (the row is answered 502)."""


def _cursor_key(cursor: str) -> tuple[int, int]:
    ms, _, seq = cursor.partition("-")
    return int(ms), int(seq or 0)


def _locs(details, prefix: tuple) -> list[tuple[tuple, str]]:
    """A farm 400's ``details`` ({field: [messages]} nested) as (location, message)."""
    if isinstance(details, dict):
        out = []
        for k, v in details.items():
            out += _locs(v, prefix if k == "_schema" else (*prefix, k))
        return out
    if isinstance(details, list) and all(isinstance(m, str) for m in details):
        return [(prefix, " ".join(details))]
    if isinstance(details, list):
        return [x for m in details for x in _locs(m, prefix)]
    return [(prefix, str(details))]


def _instance_locs(details, sub: Submission) -> list[tuple[tuple, str]]:
    """The farm's refusal of ``sub``'s instance, each field where the row holds it."""
    if not isinstance(details, dict):
        return _locs(details, sub.where)
    return [x for k, v in details.items()
            for x in _locs({k: v}, sub.where) if k not in sub.fields] + \
        [x for k, v in details.items() if k in sub.fields for x in _locs(v, sub.fields[k])]


class FarmRefused(FarmError, RuntimeError):
    """The farm's API refused the caller (401, 403: its key; 429: its quota): the row is
    answered with that status, as the API said it."""

    def __init__(self, status: int, detail: str, retry_after: str | None = None):
        super().__init__(detail)
        self.status, self.detail, self.retry_after = status, detail, retry_after


class Farm:
    """The farm's API as one caller reaches it, from the event loop: coalesced submits, one
    results poll. Each caller (its ``Authorization``) has its own: its rows are submitted
    with its key, into its own batches, under its quotas and fair share."""

    def __init__(self, url: str, authorization: str = ""):
        self.url = url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if authorization:
            self.headers["Authorization"] = authorization
        self.http = AsyncHTTPClient(max_clients=MAX_POLLS + 32)
        self._groups: dict[str, list[tuple[Submission, asyncio.Future]]] = {}
        self._waiting: dict[str, dict[str, asyncio.Future]] = {}  # batch -> job -> future
        self._cursors: dict[str, str] = {}
        self._polls = 0
        # Rows go into the server's current batch (a new one every BATCH_JOBS jobs): the
        # results of every row in flight are one or two streams to read, not one per submit.
        self._batch, self._batch_jobs = "", BATCH_JOBS
        # Results read before their submit's answer was (a fast job, a slow answer), kept
        # until the row registers (or EARLY_KEEP_S, for a row whose client went away).
        self._early: dict[str, tuple[float, dict]] = {}

    async def call(self, method: str, path: str, body=None, timeout_s: float = 60) -> dict:
        """One API call: its JSON, or HTTPClientError (4xx/5xx) / OSError."""
        resp = await self.http.fetch(
            self.url + path, method=method, headers=self.headers,
            body=None if body is None else json.dumps(body), request_timeout=timeout_s,
            connect_timeout=10)
        return json.loads(resp.body or b"{}")

    # -- submits ---------------------------------------------------------------------

    async def submit(self, sub: Submission) -> tuple[str, str, asyncio.Future]:
        """(batch id, job id, the future of its end) of ``sub``'s job: submitted with the
        rows of the same task type and sampling that arrive within ``BATCH_WINDOW_S``. The
        future holds the job's document once it ended (done, failed or cancelled)."""
        future = asyncio.get_running_loop().create_future()
        group = self._groups.setdefault(sub.key, [])
        group.append((sub, future))
        if len(group) == 1:
            asyncio.get_running_loop().call_later(BATCH_WINDOW_S, self._flush, sub.key)
        elif len(group) >= MAX_BATCH:
            self._flush(sub.key)
        return await future

    def _flush(self, key: str) -> None:
        group = self._groups.pop(key, None)
        if group:
            asyncio.ensure_future(self._submit(group))

    async def _submit(self, group: list[tuple[Submission, asyncio.Future]]) -> None:
        first = group[0][0]
        if self._batch_jobs + len(group) > BATCH_JOBS:
            self._batch, self._batch_jobs = f"gym-{uuid.uuid4().hex}", 0
        self._batch_jobs += len(group)
        body = {"handler": first.handler, "instances": [s.instance for s, _ in group],
                "sampling": first.sampling, "batch_id": self._batch}
        if first.deadline_s is not None:
            body["deadline_s"] = first.deadline_s
        try:
            doc = await self.call("POST", "/v1/jobs", body)
        except HTTPClientError as e:
            err = _error(e)
            if e.code == 400 and err.get("code") in ("invalid_instance",
                                                     "insufficient_context"):
                bad = {int(i): v for i, v in (err.get("details") or {}).get(
                    "instances", {}).items()}
                for i, (sub, future) in enumerate(group):
                    if i in bad and not future.done():
                        future.set_exception(RowError(_instance_locs(bad[i], sub)))
                rest = [g for i, g in enumerate(group) if i not in bad]
                if rest and bad:
                    await self._submit(rest)
                    return
            if e.code in (401, 403, 429):  # the caller's key or quota: said as the API said
                self._fail(group, FarmRefused(e.code, err.get("message") or str(e),
                                              e.response.headers.get("Retry-After")
                                              if e.response is not None else None))
                return
            if e.code in (400, 404, 409, 413, 422):
                row_error = RowError(_request_locs(err))
                for _, future in group:
                    if not future.done():
                        future.set_exception(row_error)
                return
            self._fail(group, FarmUnavailable(f"POST /v1/jobs: HTTP {e.code}: "
                                              f"{err.get('message') or e}"))
            return
        except (OSError, asyncio.TimeoutError) as e:
            self._fail(group, FarmUnavailable(f"POST /v1/jobs: {e}"))
            return
        batch = doc["batch_id"]
        waiting = self._waiting.setdefault(batch, {})
        self._cursors.setdefault(batch, "0-0")
        for (_, future), job_id in zip(group, doc["job_ids"]):
            done = waiting.setdefault(job_id, asyncio.get_running_loop().create_future())
            early = self._early.pop(job_id, None)
            if early is not None and not done.done():
                done.set_result(early[1])
            if not future.done():
                future.set_result((batch, job_id, done))
        self._kick()

    @staticmethod
    def _fail(group: Iterable, error: Exception) -> None:
        for _, future in group:
            if not future.done():
                future.set_exception(error)

    # -- results ---------------------------------------------------------------------

    def forget(self, batch: str, job_id: str) -> None:
        """Stop waiting for a job (its row's client went away)."""
        waiting = self._waiting.get(batch)
        if waiting is not None:
            waiting.pop(job_id, None)
            self._drop_if_idle(batch)

    def _drop_if_idle(self, batch: str) -> None:
        """Stop reading a batch no row waits on, but for the current one (rows still join
        it: its cursor stays)."""
        if not self._waiting.get(batch) and batch != self._batch:
            self._waiting.pop(batch, None)
            self._cursors.pop(batch, None)

    def _kick(self) -> None:
        if self._polls < MAX_POLLS:
            self._polls += 1
            asyncio.ensure_future(self._poll_loop())

    async def _poll_loop(self) -> None:
        failures = 0
        try:
            while any(self._waiting.values()):
                cursors = {b: self._cursors[b] for b, w in self._waiting.items() if w}
                cursors = dict(list(cursors.items())[:1000])
                try:
                    doc = await self.call("POST", "/v1/batches/results", {
                        "cursors": cursors, "limit": 1000, "wait": POLL_WAIT_S},
                        timeout_s=POLL_WAIT_S + 60)
                    failures = 0
                except (HTTPClientError, OSError, asyncio.TimeoutError) as e:
                    failures += 1
                    pause = backoff_s(failures, RETRY_S, RETRY_MAX_S)
                    log.warning("gym: reading results failed (%s); again in %g s", e, pause)
                    await asyncio.sleep(pause)
                    continue
                self._deliver(doc["batches"])
        finally:
            self._polls -= 1

    def _deliver(self, batches: dict) -> None:
        now = time.monotonic()
        for job_id in [k for k, (t, _) in self._early.items() if now - t > EARLY_KEEP_S]:
            del self._early[job_id]
        for batch, page in batches.items():
            waiting = self._waiting.get(batch)
            if waiting is None:
                continue
            if not page.get("found"):
                for future in waiting.values():
                    if not future.done():
                        future.set_exception(FarmUnavailable(
                            f"batch {batch} is no longer stored by the farm"))
                self._waiting.pop(batch, None)
                self._cursors.pop(batch, None)
                continue
            for job in page["results"]:
                future = waiting.pop(job["id"], None)
                if future is None:
                    self._early[job["id"]] = (now, job)
                elif not future.done():
                    future.set_result(job)
            if _cursor_key(page["cursor"]) > _cursor_key(self._cursors.get(batch, "0-0")):
                self._cursors[batch] = page["cursor"]
            self._drop_if_idle(batch)

    async def cancel(self, job_id: str) -> None:
        try:
            await self.call("POST", f"/v1/jobs/{job_id}/cancel", {})
        except (HTTPClientError, OSError, asyncio.TimeoutError) as e:
            log.warning("gym: cancelling job %s failed: %s", job_id, e)


class Callers:
    """Who calls the Gym server, and each caller's :class:`Farm`. On a farm with keys
    (``PRORL_API_TOKEN``, ``PRORL_TENANTS``) every route but the probes needs one of them;
    a caller's rows go to the API with the caller's own key, never with another's (the
    server holds no key of its own). On a farm without keys every caller is the one
    (loopback) operator."""

    def __init__(self, farm_url: str, api_token: str = "", tenants: dict | None = None,
                 own_key: str = ""):
        self.farm_url = farm_url
        self.api_token, self.tenants = api_token, tenants or {}
        self.keyed = any_key(api_token, self.tenants)
        self._farms: dict[str, Farm] = {}
        # A tenant's own server (``--key-file``): a caller without a key is that tenant.
        self.own = f"Bearer {own_key}" if own_key else ""
        if own_key and identify(self.own, api_token, self.tenants)[1] is None:
            raise ConfigError("--key-file: not the key of one of this farm's tenants (the "
                              "operator's key is never a Gym server's)")

    def who(self, authorization: str | None) -> str | None:
        """``operator``, ``tenant:<name>``, or None (no key the farm knows)."""
        if self.own:
            if authorization is None:
                authorization = self.own
            elif not token_ok(authorization, self.own.partition(" ")[2]):
                return None
        if not self.keyed:
            return "operator"
        operator, tenant = identify(authorization, self.api_token, self.tenants)
        if operator:
            return "operator"
        return f"tenant:{tenant.name}" if tenant else None

    def farm(self, caller: str, authorization: str | None) -> Farm:
        authorization = authorization or self.own
        farm = self._farms.get(caller)
        if farm is None:
            farm = self._farms[caller] = Farm(
                self.farm_url, (authorization or "") if self.keyed else "")
        return farm


def _error(e: HTTPClientError) -> dict:
    try:
        return json.loads(e.response.body)["error"]
    except Exception:  # noqa: BLE001 - not the farm's error shape
        return {}


def _request_locs(err: dict) -> list[tuple[tuple, str]]:
    details = err.get("details") or {}
    out = []
    for name, value in details.items():
        where = {"sampling": ("responses_create_params",), "handler": ("prorl", "handler"),
                 "deadline_s": ("prorl", "deadline_s")}.get(name, (name,))
        out += _locs(value, where)
    return out or [((), err.get("message") or "refused by the farm")]


# -- HTTP ------------------------------------------------------------------------------


class _Base(RequestHandler):
    farm: Farm

    def initialize(self, callers: Callers, sessions: dict,
                   resources_server: dict | None = None, grader: str | None = None):
        self.callers, self.sessions = callers, sessions
        self.resources_server = resources_server or {}
        self.grader = grader

    def prepare(self):
        # On a farm with keys, every caller shows one (the probes excepted); what it runs
        # runs with that key, as its tenant.
        header = self.request.headers.get("Authorization")
        self.caller = self.callers.who(header)
        if self.caller is None and not isinstance(self, HealthHandler):
            self.set_header("WWW-Authenticate", 'Bearer realm="prorl-farm-gym"')
            raise HTTPError(401, "this server needs 'Authorization: Bearer <your farm "
                            "key>' (a tenant's, or the operator's)")
        if self.caller is not None:
            self.farm = self.callers.farm(self.caller, header)

    def _json(self):
        try:
            return json.loads(self.request.body or b"null")
        except ValueError as e:
            raise HTTPError(400, f"the body is not JSON: {e}") from e

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None))[1]
        detail = exc.log_message if isinstance(exc, HTTPError) and exc.log_message else \
            self._reason
        self.finish({"detail": detail})

    def reply(self, status: int, doc) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(doc))


class RunHandler(_Base):
    """``POST /run``: the row's farm job, its answer when it ends."""

    async def post(self):
        row = self._json()
        try:
            sub = to_submission(row, self.resources_server, self.grader)
            batch, job_id, ended = await self.farm.submit(sub)
        except RowError as e:
            return self.refuse(row, e)
        except FarmRefused as e:
            if e.retry_after:
                self.set_header("Retry-After", e.retry_after)
            return self.reply(e.status, {"detail": e.detail})
        except FarmUnavailable as e:
            return self.reply(502, {"detail": str(e)})
        self._job, self._ended = (batch, job_id), ended
        if getattr(self, "_gone", False):  # the client left while the row was submitted
            self.on_connection_close()
            return
        try:
            job = await ended
        except FarmUnavailable as e:
            return self.reply(502, {"detail": str(e)})
        except asyncio.CancelledError:  # the client went away (on_connection_close)
            return
        self._job = None
        self.reply(200, self.answer(row, job, sub))

    def answer(self, row: dict, job: dict, sub: Submission) -> dict:
        return run_answer(row, job, sub.parser)

    def refuse(self, row, error: RowError) -> None:
        log.info("gym: row refused: %s", error)
        self.reply(200, refused(row, error))

    def on_connection_close(self) -> None:
        self._gone = True
        job, self._job = getattr(self, "_job", None), None
        if job is not None:  # the client went away: its job is not wanted any more
            self.farm.forget(*job)
            self._ended.cancel()
            asyncio.ensure_future(self.farm.cancel(job[1]))


class ResponsesHandler(RunHandler):
    """``POST /v1/responses``: a Responses create body's episode (``chat``), no reward."""

    async def post(self):
        body = self._json()
        if not isinstance(body, dict):
            return self.reply(422, {"detail": RowError([((), "a JSON object")]).detail()})
        row = {"responses_create_params": body, "expected_answer": "\u2063",
               "prorl_grader": "contains"}
        self.request.body = json.dumps(row).encode()
        self.resources_server = {}  # a bare Responses body is a chat episode
        await super().post()

    def refuse(self, row, error: RowError) -> None:  # the Responses API's own refusal
        self.reply(422, {"detail": error.detail()})

    def answer(self, row: dict, job: dict, sub: Submission) -> dict:
        return response_object(row, job, sub.parser)  # a failed job's carries its error


class AggregateHandler(_Base):
    async def post(self):
        body = self._json()
        rows = body.get("verify_responses") if isinstance(body, dict) else None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            return self.reply(422, {"detail": [{"type": "value_error",
                                                "loc": ["body", "verify_responses"],
                                                "msg": "a list of objects"}]})
        self.reply(200, aggregate(rows))


class SessionHandler(_Base):
    """Gym's agent sessions: seeding is idempotent per id; closing returns nothing the
    farm observed (its jobs carry their own record)."""

    async def post(self, close: str | None = None):
        body = self._json()
        given = body.get("agent_session_id") if isinstance(body, dict) else None
        if not isinstance(given, str) or not given:
            return self.reply(422, {"detail": [{"type": "value_error",
                                                "loc": ["body", "agent_session_id"],
                                                "msg": "a non-empty string"}]})
        sid = (self.caller, given)  # each caller's session ids are its own
        now = time.monotonic()
        for old in [k for k, (_, closed) in self.sessions.items()
                    if closed and now - closed > SESSION_KEEP_S]:
            del self.sessions[old]
        if close:
            episode = self.sessions.get(sid, (body.get("episode_id"), None))[0]
            self.sessions[sid] = (episode, now)
            return self.reply(200, {"agent_session_id": given, "agent_observations": None,
                                    "resources_cookies": None})
        known = self.sessions.get(sid)
        if known is not None and known[1] is not None:
            return self.reply(409, {"detail": f"agent session {given} was closed"})
        self.sessions[sid] = (body.get("episode_id"), None)
        self.reply(200, {"agent_session_id": given})


class HealthHandler(_Base):
    async def get(self):
        self.reply(200, {"status": "ok"})


def make_app(farm_url: str, resources_server: str = "", grader: str = "",
             api_token: str = "", tenants: dict | None = None, own_key: str = ""
             ) -> Application:
    """``api_token`` and ``tenants``: the farm's keys (its settings), which callers must
    show where there are any (:class:`Callers`; ``own_key``: a tenant's own server's);
    ``resources_server`` and ``grader``: where rows naming no farm task go
    (rows.to_submission)."""
    shared = {"callers": Callers(farm_url, api_token, tenants, own_key), "sessions": {},
              "resources_server": parse_servers(resources_server),
              "grader": grader or None}
    return Application([
        (r"/run", RunHandler, shared),
        (r"/aggregate_metrics", AggregateHandler, shared),
        (r"/v1/responses", ResponsesHandler, shared),
        (r"/v1/agent_sessions(/close)?", SessionHandler, shared),
        (r"/(?:healthz|readyz|livez)?", HealthHandler, shared),
    ], max_body_size=64 << 20)


async def serve(host: str, port: int, farm_url: str, api_token: str = "",
                ready=None, resources_server: str = "", grader: str = "",
                tenants: dict | None = None, own_key: str = "") -> None:
    """Serve until cancelled. ``resources_server``: the Gym resources servers that rows
    naming no farm task run on (``URL`` or ``NAME=URL``, comma-separated: rows.py);
    ``grader``: the farm grader of rows graded by ``expected_answer`` alone. ``api_token``
    and ``tenants``: the farm's keys, which its callers show (the server submits with the
    caller's key, never one of its own). Off loopback, only on a farm with keys.
    ``own_key``: a tenant's own server, for collectors that send no key (loopback only)."""
    try:
        parse_servers(resources_server)
    except ValueError as e:
        raise ConfigError(f"--resources-server {e}") from None
    if not is_loopback(host) and not any_key(api_token, tenants or {}):
        raise ConfigError(f"the Gym server on {host} (not loopback) would submit to the farm "
                          "for anyone: run the farm with keys (PRORL_API_TOKEN, "
                          "PRORL_TENANTS), which its callers then show, or bind it to "
                          "loopback")
    if own_key and not is_loopback(host):
        raise ConfigError(f"--key-file: a tenant's own Gym server runs rows without a key "
                          f"as that tenant: bind it to loopback, not {host}")
    server = HTTPServer(make_app(farm_url, resources_server, grader, api_token, tenants,
                                 own_key),
                        max_body_size=64 << 20, idle_connection_timeout=3600)
    server.listen(port, host, backlog=1024)
    log.info("gym agent server on http://%s:%d, the farm at %s%s", host, port, farm_url,
             f", rows to the resources servers {resources_server}" if resources_server
             else "")
    if ready is not None:
        ready()
    try:
        await asyncio.Event().wait()
    finally:
        server.stop()
