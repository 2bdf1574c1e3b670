"""``gym``: a NeMo Gym resources server's environment, run on the farm's queues.

A Gym resources server (``nemo_gym.base_resources_server.SimpleResourcesServer``) holds an
environment's tools and its verifier behind HTTP: ``POST /seed_session`` starts a rollout's
state (a session cookie names it), ``POST /<tool>`` runs a tool call, ``POST /verify``
grades the finished rollout. This handler speaks that protocol as Gym's own ``simple_agent``
does, with the farm's token-in/token-out loop as the agent:

- INIT seeds the session with the whole Gym row (its task fields too) and keeps the cookies;
- RUN runs the agent loop on the row's messages with the row's function tools, each call a
  ``POST {server}/{name}`` of its arguments with the session's cookies (an HTTP error's body
  is the model's observation, as in Gym); a row without tools is one model call, its text
  the answer (Gym's single-turn environments);
- EVAL posts the row and the episode as Gym's ``response`` (the items ``/run`` answers
  with, token ids included) to ``/verify``; its ``reward`` is the job's.

The policy sees the row's ``responses_create_params`` only (the task fields, such as an
expected answer, stay with INIT and EVAL). It reaches the server through the tools the row
declares and nothing else: a tool named like one of the server's own routes (``verify``,
``seed_session``...) is refused at submit, and a call of an undeclared name never leaves the
farm. A server that cannot be reached (``EnvironmentUnreachable``), answers
``/seed_session`` or ``/verify`` with an error, gives no finite reward, or masks its own
verdict (``mask_sample``, at the top level or in ``instance_config``) fails the job: a
failure is never a zero reward.
"""

from __future__ import annotations

import json
import math

import requests
from marshmallow import ValidationError, fields, validate, validates_schema

from prorl_farm.agent.loop import AgentLimits, run_episode
from prorl_farm.agent.parsers import get_parser
from prorl_farm.agent.tools import truncate
from prorl_farm.errors import EnvironmentFailed, EnvironmentUnreachable, GradingError
from prorl_farm.gym.rows import (
    RESERVED,
    ROLES,
    TOOL_NAME,
    RowError,
    messages_of,
    response_object,
    tool_errors,
)
from prorl_farm.handlers.agentic import LoopOptions
from prorl_farm.handlers.base import AgentHandler, JobContext

# What EVAL keeps of /verify's answer beside the reward (the row and response it echoes are
# the job's own already).
ECHOED = frozenset({"responses_create_params", "response", "reward"})
KEEP_CHARS = 16_000


# A resources server's URL: http(s), a host name, IPv4 or [IPv6] address, a port (1-65535),
# a path (printable ASCII: what is not, percent-encoded; Python's and ECMA's \S differ).
_PORT = r"(:(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3}))"
URL = rf"^https?://([A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]){_PORT}?(/[!-~]*)?$"
# The same on loopback only: what the backend allow-list takes with PRORL_BACKEND_ALLOW empty.
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
LOOPBACK_URL = (rf"^https?://(localhost|127\.{_OCTET}\.{_OCTET}\.{_OCTET}|\[::1\])"
                rf"{_PORT}?(/[!-~]*)?$")
_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["input_text", "output_text", "text"]},
    "text": {"type": "string"}}}
# The items of a row's input that rows.messages_of takes: messages, and a conversation's
# function calls, their outputs (any value) and reasoning (left out).
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "type": {"type": "string", "enum": ["message"]},
    "role": {"type": "string", "enum": sorted(ROLES)},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}
_FUNCTION_CALL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"type": "string", "enum": ["function_call"]}, "name": {"type": "string"}}}


def _item_of(kind: str) -> dict:
    return {"type": "object", "required": ["type"],
            "properties": {"type": {"type": "string", "enum": [kind]}}}


# What the row must hold (rows.messages_of, rows.tool_errors), published with the instance
# schema. Tool names must also differ from each other, which JSON Schema cannot say.
ROW_SCHEMA = {"type": "object", "required": ["responses_create_params"], "properties": {
    "responses_create_params": {"type": "object", "required": ["input"],
                                "properties": {
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {
            "anyOf": [_MESSAGE, _FUNCTION_CALL, _item_of("function_call_output"),
                      _item_of("reasoning")]}}]},
        "instructions": {"type": "string"},
        "tools": {"type": "array", "uniqueItems": True, "items": {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "name": {"type": "string", "pattern": TOOL_NAME.pattern,
                         "not": {"enum": sorted(RESERVED)}},
                "parameters": {"type": "object"}}}}}}}}


class GymInstance(LoopOptions):
    server = fields.String(required=True, validate=validate.Regexp(
        URL, error="an http(s) URL of the resources server"))
    # The Gym data row: ``responses_create_params`` (input, function tools if any) and its
    # task fields, as the resources server's seed_session and verify read them.
    row = fields.Dict(required=True)

    @validates_schema
    def _row(self, data, **kwargs):
        params = data["row"].get("responses_create_params")
        if not isinstance(params, dict):
            raise ValidationError({"row": {"responses_create_params": ["required: an object"]}})
        try:
            messages_of(params)
        except RowError as e:
            raise ValidationError({"row": [str(e)]}) from None
        errors = tool_errors(params.get("tools"))
        if errors:
            raise ValidationError({"row": {"responses_create_params": {"tools": errors}}})


def _schemas(params: dict) -> dict[str, dict]:
    """The row's Responses function tools as the chat template's tool schemas."""
    return {t["name"]: {"type": "function", "function": {
        "name": t["name"], "description": t.get("description") or "",
        "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}
        for t in params.get("tools") or []}


def _cookies(response: requests.Response) -> dict:
    return {c.name: c.value for c in response.cookies}


class GymTools:
    """Runs the row's tool calls on the resources server, the session's cookies carried from
    call to call as Gym's agent carries them."""

    def __init__(self, server: str, cookies: dict, timeout_s: float):
        self.server, self.cookies, self.timeout_s = server.rstrip("/"), dict(cookies), timeout_s
        self.http = requests.Session()

    def run(self, name: str, args: dict, abort_hook=None, timeout_s: float | None = None
            ) -> tuple[str, bool]:
        # The loop runs only declared names, and those were checked at submit.
        assert TOOL_NAME.match(name) and name not in RESERVED, name
        try:
            r = self.http.post(f"{self.server}/{name}", json=args, cookies=self.cookies,
                               timeout=timeout_s or self.timeout_s)
        except requests.Timeout:
            return f"error: the tool took more than {timeout_s or self.timeout_s:g} s", False
        except requests.RequestException as e:
            raise EnvironmentUnreachable(f"the resources server {self.server} is "
                                         f"unreachable: {e}") from e
        self.cookies.update(_cookies(r))
        return r.text, r.ok

    def close(self) -> None:
        self.http.close()


class GymHandler(AgentHandler):
    name = "gym"
    description = ("A NeMo Gym resources server's environment: seed_session, the row's tools "
                   "over HTTP, verify for the reward.")
    instance_schema = GymInstance
    property_schemas = {"row": ROW_SCHEMA}

    def allowed_by(self, settings) -> dict:
        return {} if settings.backend_allow else {"server": {"pattern": LOOPBACK_URL}}

    def refusals(self, instance: dict, settings) -> dict:
        """The server is a URL every INIT, RUN and EVAL worker will POST to: it must pass
        the allow-list backends pass (loopback, PRORL_BACKEND_ALLOW; never the farm's
        Redis)."""
        from prorl_farm.access import backend_url_refusal, parse_allow_list

        why = backend_url_refusal(instance["server"], parse_allow_list(settings.backend_allow),
                                  settings.farm_listeners())
        return {"server": [why]} if why else {}

    def visible_instance(self, instance: dict) -> dict:
        """RUN gets the row's prompt and tools, never its task fields."""
        out = {k: v for k, v in instance.items() if k != "row"}
        out["responses_create_params"] = instance["row"]["responses_create_params"]
        return out

    def init(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        r = _post(inst["server"], "seed_session", inst["row"], {}, _timeout(ctx),
                  EnvironmentFailed)
        return {"cookies": _cookies(r)}

    def run(self, ctx: JobContext) -> dict:
        inst = ctx.instance
        params = inst["responses_create_params"]
        schemas = _schemas(params)
        limits = AgentLimits.from_job(inst, ctx.sampling)
        tools = GymTools(inst["server"], ctx.state.get("cookies") or {}, limits.call_timeout_s)
        try:
            traj, ep = run_episode(ctx, messages_of(params), list(schemas),
                                   get_parser(inst["parser"]), limits, tools, schemas=schemas)
        finally:
            tools.close()
        return {**traj.to_dict(), "stats": ep.stats(), "gym_cookies": tools.cookies}

    def eval(self, ctx: JobContext) -> dict:
        inst, result = ctx.instance, ctx.result or {}
        job = {"id": ctx.job_id, "state": "done", "result": result, "sampling": ctx.sampling}
        body = {**inst["row"], "response": response_object(inst["row"], job, inst["parser"])}
        cookies = result.get("gym_cookies") or ctx.state.get("cookies") or {}
        r = _post(inst["server"], "verify", body, cookies, _timeout(ctx), GradingError)
        try:
            verdict = r.json()
        except ValueError:
            raise GradingError(f"/verify answered no JSON: {r.text[:500]}") from None
        reward = verdict.get("reward") if isinstance(verdict, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or \
                not math.isfinite(reward):
            raise GradingError(f"/verify gave no finite reward: {r.text[:500]}")
        config = verdict.get("instance_config")
        if verdict.get("mask_sample") or isinstance(config, dict) and config.get("mask_sample"):
            # (Gym's verifiers mask at the top level, and in instance_config where NeMo RL
            # reads it: either way the reward is no measurement.)
            raise GradingError(f"/verify masked its own verdict "
                               f"({verdict.get('failure_kind')}): "
                               f"{verdict.get('failure_reason') or ''}"[:2000])
        kept = {k: v for k, v in verdict.items() if k not in ECHOED and k not in inst["row"]}
        text = json.dumps(kept)
        return {"reward": float(reward),
                "verify": kept if len(text) <= KEEP_CHARS else truncate(text, KEEP_CHARS)}


def _timeout(ctx: JobContext) -> float:
    ctx.check()
    wanted = ctx.instance.get("call_timeout_s") or 60.0
    return max(0.1, min(wanted, ctx.remaining_s))


def _post(server: str, route: str, body: dict, cookies: dict, timeout_s: float,
          error: type[Exception]) -> requests.Response:
    """POST one of the resources server's own routes: an error answer raises ``error``,
    no answer at all ``EnvironmentUnreachable``."""
    url = f"{server.rstrip('/')}/{route}"
    try:
        r = requests.post(url, json=body, cookies=cookies, timeout=timeout_s)
    except requests.RequestException as e:
        raise EnvironmentUnreachable(f"{url}: {e}") from e
    if not r.ok:
        raise error(f"{url} answered {r.status_code}: {r.text[:1000]}")
    return r
