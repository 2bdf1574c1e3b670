"""NeMo Gym's rows as farm jobs, and farm jobs as Gym's ``/run`` answers.

A Gym data row (what ``ng_collect_rollouts`` and NeMo RL's ``NemoGym`` environment POST to
an agent's ``/run``) holds ``responses_create_params`` (an OpenAI Responses create body:
``input`` required, no key Gym's ``NeMoGymResponseCreateParamsNonStreaming`` lacks) and any
dataset fields, ``agent_ref`` and Gym's ``_ng_*`` / ``_rowidx`` metadata. The farm task a
row becomes (docs/trainers.md, "NeMo Gym"), the first rule that applies:

1. ``prorl: {"handler": NAME, "instance": {...}, "deadline_s": S}``: that farm task, as
   given (any handler: ``math``, ``swe``, ``code``, an ``agent`` harness...);
2. ``prorl: {"resources_server": URL}``, or a resources server the Gym server was given for
   the row's agent (``--resources-server NAME=URL``, ``NAME`` the row's ``agent_ref.name``)
   or for every row (``--resources-server URL``): ``gym``, the environment of that Gym
   resources server (handlers/gym.py: its ``/seed_session``, the row's function tools if it
   has any, its ``/verify`` for the reward), the row sent to it as Gym's own agent sends it;
3. ``expected_answer`` and a farm grader named, by the row (``prorl_grader``) or for every
   row (``--grader``): ``math``, the row's last user message the problem as written
   (``prompt_template: "{problem}"``), its ``developer``/``system`` messages and
   ``instructions`` the system prompt, the farm's ``python`` tool offered, the final
   ``\\boxed{}`` graded by math-verify against ``expected_answer``; or ``contains``: a
   ``chat`` job, the row's messages as given, no tools, reward 1 when the final answer
   contains ``expected_answer``;
4. else the row is refused. An ``expected_answer`` alone does not say how it is compared
   (Gym's string_match, mcqa and math_with_judge rows look alike and are graded three ways):
   the farm grades nothing by a guess.

Sampling comes from ``responses_create_params``: ``temperature``, ``top_p``,
``max_output_tokens`` (per model call: the farm's ``max_tokens``), ``max_tool_calls``
(``max_turns`` = calls + 1). ``prorl_sampling`` adds any other farm sampling field.

The answer is the row, plus ``response`` (a Responses object whose ``output`` is the
episode: per model call its items, the last carrying ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs`` exactly as the farm stored them;
tool results as ``function_call_output`` items) and ``reward``. A row that did not earn a
reward is answered as Gym's own servers answer one (:func:`run_answer`, :func:`refused`):
masked when the model generated, a failure record otherwise; never a zero reward that
reads as a measurement.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
import uuid
from dataclasses import dataclass, field

from prorl_farm.agent.parsers import get_parser, split_reasoning
from prorl_farm.errors import FarmError

# NeMoGymResponseCreateParamsNonStreaming's fields (nemo-gym 0.7.0; it forbids others).
CREATE_PARAMS = frozenset({
    "background", "context_management", "conversation", "include", "input", "instructions",
    "max_output_tokens", "max_tool_calls", "metadata", "model", "moderation",
    "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store",
    "stream", "stream_options", "temperature", "text", "tool_choice", "tools",
    "top_logprobs", "top_p", "truncation", "user"})
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
GRADERS = ("math", "contains")
# The farm's failure kinds (states.FailureKind) as Gym's (nemo_gym/failure_kinds.py).
FAILURE_KINDS = {
    "timeout": "agent_timeout", "cancelled": "cancelled",
    "backend_unavailable": "provider_unavailable", "invalid_instance": "agent_run_error",
    "init_error": "session_lost", "run_error": "agent_run_error",
    "eval_error": "verifier_error", "harness_error": "agent_run_error",
    "worker_lost": "kill_shaped", "storage_error": "persistence_failed",
}

# The server's own routes (nemo_gym's RESERVED_MCP_TOOL_NAMES, and the routes beside them):
# a tool of one of these names would let the policy call the grader.
RESERVED = frozenset({"verify", "seed_session", "close_session", "aggregate_metrics", "mcp",
                      "reverify_mode", "docs", "openapi.json", "redoc"})
TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


def tool_errors(tools) -> list[str]:
    """What is wrong with a resources server row's tools (none, or function tools, each
    with a name that is none of the server's own routes), or []."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        return ["a list of function tools (the resources server's)"]
    errors, seen = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            errors.append(f"{i}: only function tools run on a resources server")
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            errors.append(f"{i}: name must match {TOOL_NAME.pattern}")
        elif name in RESERVED:
            errors.append(f"{i}: {name!r} is one of the resources server's own routes")
        elif name in seen:
            errors.append(f"{i}: {name!r} is declared twice")
        seen.add(name)
        if not isinstance(tool.get("parameters", {}), dict):
            errors.append(f"{i}: parameters must be a JSON Schema object")
    return errors


class RowError(FarmError, ValueError):
    """A row the farm cannot take: ``errors`` are (location, message) pairs, the location
    a path into the row as Gym's FastAPI validation writes it."""

    def __init__(self, errors: list[tuple[tuple, str]]):
        super().__init__("; ".join(f"{'.'.join(map(str, loc))}: {msg}" for loc, msg in errors))
        self.errors = errors

    def detail(self) -> list[dict]:
        """FastAPI's 422 ``detail``: what Gym's own servers answer a bad body with."""
        return [{"type": "value_error", "loc": ["body", *loc], "msg": msg}
                for loc, msg in self.errors]


@dataclass
class Submission:
    """A row's farm job: ``key`` groups rows one POST /v1/jobs may carry together."""

    handler: str
    instance: dict
    sampling: dict
    deadline_s: float | None = None
    parser: str = "hermes"
    where: tuple = ("responses_create_params",)  # what the farm's refusal of it points at
    fields: dict = field(default_factory=dict)  # instance fields found elsewhere in the row
    key: str = field(init=False)

    def __post_init__(self):
        self.key = json.dumps([self.handler, self.sampling, self.deadline_s], sort_keys=True)


def _text(content, loc: tuple) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in (
                    "input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise RowError([((*loc, i), "only text parts are taken (input_text, "
                                            "output_text)")])
            parts.append(part["text"])
        return "".join(parts)
    raise RowError([(loc, "content must be a string or a list of text parts")])


def messages_of(params: dict) -> list[dict]:
    """The row's input as chat messages (``developer`` as ``system``; text only): messages,
    and the function calls of a conversation so far (``function_call`` items joined to the
    assistant message before them, or making one, ``function_call_output`` items as tool
    messages; ``reasoning`` items left out), as the chat template takes them."""
    loc = ("responses_create_params", "input")
    raw = params.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise RowError([(loc, "a string or a non-empty list of messages")])
    out: list[dict] = []
    if isinstance(params.get("instructions"), str) and params["instructions"]:
        out.append({"role": "system", "content": params["instructions"]})
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call" and isinstance(item.get("name"), str):
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append({"type": "function", "function": {
                "name": item["name"], "arguments": _arguments(item.get("arguments"))}})
        elif kind == "function_call_output":  # a tool's output as the model reads it
            output = item.get("output")
            out.append({"role": "tool", "content": output if isinstance(output, str) else
                        _text(output, (*loc, i, "output")) if _text_parts(output)
                        else json.dumps(output)})
        elif kind == "reasoning":
            continue  # an earlier call's reasoning: chat templates leave it out of history
        elif kind == "message" and item.get("role") in ROLES:
            out.append({"role": ROLES[item["role"]], "content": _text(item.get("content"),
                                                                       (*loc, i, "content"))})
        else:
            raise RowError([((*loc, i), "the farm takes messages (role user, system, "
                                        "developer or assistant), function_call, "
                                        "function_call_output and reasoning items as a "
                                        "row's input")])
    return out


def _text_parts(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
        and isinstance(p.get("text"), str) for p in value)


def _arguments(raw):
    """A function call's arguments as the chat template takes them: an object."""
    if isinstance(raw, str):
        try:
            value = json.loads(raw or "{}")
        except ValueError:
            return raw
        return value
    return raw if raw is not None else {}


def _sampling(row: dict, params: dict) -> dict:
    loc = ("responses_create_params",)
    out = {}
    for name, key in (("temperature", "temperature"), ("top_p", "top_p"),
                      ("max_output_tokens", "max_tokens")):
        value = params.get(name)
        if value is None:
            continue
        ok = isinstance(value, int) if key == "max_tokens" else \
            isinstance(value, (int, float)) and math.isfinite(value)
        if not ok or isinstance(value, bool):
            raise RowError([((*loc, name), "a number" if key != "max_tokens" else
                             "an integer")])
        out[key] = value
    calls = params.get("max_tool_calls")
    if calls is not None:
        if not isinstance(calls, int) or isinstance(calls, bool) or calls < 0:
            raise RowError([((*loc, "max_tool_calls"), "a non-negative integer")])
        out["max_turns"] = calls + 1
    extra = row.get("prorl_sampling")
    if extra is not None:
        if not isinstance(extra, dict):
            raise RowError([(("prorl_sampling",), "an object of farm sampling fields")])
        out.update(extra)
    return out


def _gym(row: dict, params: dict, sampling: dict, server, deadline_s=None) -> Submission:
    """A row for a Gym resources server: the farm's ``gym`` task (handlers/gym.py)."""
    if not isinstance(server, str) or not server.startswith(("http://", "https://")):
        raise RowError([(("prorl", "resources_server"), "the resources server's URL "
                                                        "(http:// or https://)")])
    messages_of(params)
    errors = tool_errors(params.get("tools"))
    if errors:
        raise RowError([(("responses_create_params", "tools"), "; ".join(errors))])
    task = {k: v for k, v in row.items() if k not in ("prorl", "prorl_sampling")}
    return Submission("gym", {"server": server, "row": task}, sampling, deadline_s,
                      fields={"server": ("prorl", "resources_server"), "row": ()})


def parse_servers(spec: str) -> dict[str, str]:
    """``--resources-server``'s value: comma-separated ``URL`` (every row's) or
    ``NAME=URL`` (the rows whose ``agent_ref.name`` is NAME) as {name or "": URL}."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        name, _, url = part.partition("=") if "=" in part.split("://", 1)[0] else \
            ("", "", part)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{part!r}: a resources server is URL or NAME=URL "
                             "(http:// or https://)")
        if name in out:
            raise ValueError(f"{part!r}: {'the default' if not name else name} is given twice")
        out[name] = url
    return out


def agent_name(row: dict) -> str | None:
    ref = row.get("agent_ref")
    return ref.get("name") if isinstance(ref, dict) and isinstance(ref.get("name"), str) \
        else None


NO_GRADER = ("the farm has no grader for this row. Gym grades a row by its environment's "
             "/verify, and an expected_answer alone does not say how (string_match, mcqa and "
             "math_with_judge rows look alike and are compared three ways). Run it on its "
             "environment: `prorl-farm gym --resources-server URL` (or NAME=URL for the rows "
             "whose agent_ref.name is NAME), or the row's prorl.resources_server; or name "
             "the farm's grader: prorl_grader \"math\" (math-verify on the last \\boxed{}) or "
             "\"contains\" (per row, or `prorl-farm gym --grader` for every row); or a farm "
             "task: prorl {handler, instance}")


def to_submission(row, resources_server: str | dict | None = None,
                  grader: str | None = None) -> Submission:
    """The farm job of a Gym row, or :class:`RowError` naming what is wrong.
    ``resources_server``: where rows that name no farm task go (the Gym server's
    ``--resources-server``: a URL, or {agent name or "": URL}); ``grader``: the farm grader
    of rows graded by ``expected_answer`` that name none (``--grader``)."""
    if not isinstance(row, dict):
        raise RowError([((), "a JSON object")])
    params = _create_params(row)
    sampling = _sampling(row, params)
    if row.get("prorl") is not None:
        return _named_task(row, params, sampling)
    servers = resources_server if isinstance(resources_server, dict) else \
        {"": resources_server} if resources_server else {}
    server = servers.get(agent_name(row) or "") or servers.get("")
    if server:
        return _gym(row, params, sampling, server)
    return _farm_graded(row, params, sampling, row.get("prorl_grader", grader))


def _create_params(row: dict) -> dict:
    """The row's ``responses_create_params``, checked as Gym's model checks it."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        raise RowError([(("responses_create_params",), "required: an object (the Responses "
                                                       "create body)")])
    unknown = sorted(set(params) - CREATE_PARAMS)
    if unknown:
        raise RowError([(("responses_create_params", k), "extra inputs are not permitted")
                        for k in unknown])
    if "input" not in params:
        raise RowError([(("responses_create_params", "input"), "required")])
    if params.get("stream"):
        raise RowError([(("responses_create_params", "stream"), "/run answers whole: "
                                                               "stream must be false")])
    return params


def _named_task(row: dict, params: dict, sampling: dict) -> Submission:
    """A row whose ``prorl`` names the farm task, or the resources server, it runs on."""
    explicit = row["prorl"]
    if not isinstance(explicit, dict) or not (
            "resources_server" in explicit or isinstance(explicit.get("handler"), str)
            and isinstance(explicit.get("instance"), dict)):
        raise RowError([(("prorl",), "an object with 'handler' (a farm task type) and "
                                     "'instance' (its instance), or with "
                                     "'resources_server' (a Gym resources server's URL)")])
    deadline = explicit.get("deadline_s")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(
            deadline, (int, float)) or not 0 < deadline < math.inf):
        raise RowError([(("prorl", "deadline_s"), "a positive number of seconds")])
    if "resources_server" in explicit:
        return _gym(row, params, sampling, explicit["resources_server"], deadline)
    return Submission(explicit["handler"], explicit["instance"], sampling, deadline,
                      explicit["instance"].get("parser") or "hermes", ("prorl", "instance"))


def _farm_graded(row: dict, params: dict, sampling: dict, grader: str | None) -> Submission:
    """A row graded by its ``expected_answer`` with the farm grader named (``contains``: a
    chat job; ``math``: a math job on its one problem); refused without one."""
    if "expected_answer" not in row:
        raise RowError([(("prorl",), NO_GRADER)])
    if grader is None:
        raise RowError([(("prorl_grader",), NO_GRADER)])
    if grader not in GRADERS:
        raise RowError([(("prorl_grader",), f"one of {', '.join(GRADERS)}")])
    answer = row["expected_answer"]
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise RowError([(("expected_answer",), "a non-empty string (or a number)")])
    messages = messages_of(params)
    if params.get("tools"):
        raise RowError([(("responses_create_params", "tools"), "the farm's graders run the "
                                                              "farm's own tools (math: "
                                                              "python); a row's tools run on "
                                                              "its resources server: give "
                                                              "--resources-server")])
    if grader == "contains":
        return Submission("chat", {"messages": messages, "answer": answer}, sampling)
    if messages[-1]["role"] != "user":
        raise RowError([(("responses_create_params", "input"), "a math row ends with the "
                                                              "user's problem")])
    system = "\n\n".join(m["content"] for m in messages[:-1] if m["role"] == "system")
    if any(m["role"] == "assistant" for m in messages[:-1]) or \
            sum(m["role"] == "user" for m in messages) != 1:
        raise RowError([(("responses_create_params", "input"), "a math row holds one user "
                                                              "message (and system or developer"
                                                              " ones)")])
    instance = {"problem": messages[-1]["content"], "answer": answer,
                "prompt_template": "{problem}"}
    if system:
        instance["system"] = system
    return Submission("math", instance, sampling)


# -- the answer --------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _turn_items(text: str, parser, ids: dict) -> tuple[list[dict], list[str]]:
    """One model call's output items (reasoning, message, function calls) and the call ids
    its tool results answer, in order; the token ids go on the last item."""
    reasoning, rest = split_reasoning(text)
    parsed = parser.parse(rest)
    items: list[dict] = []
    if reasoning:
        items.append({"type": "reasoning", "id": _id("rs"),
                      "summary": [{"type": "summary_text", "text": reasoning}]})
    said = parser.without_calls(rest) if parsed.calls or parsed.errors else rest
    call_ids = []
    if said or not parsed.calls:
        items.append({"type": "message", "id": _id("msg"), "role": "assistant",
                      "status": "completed", "content": [
                          {"type": "output_text", "text": said, "annotations": []}]})
    for call in parsed.calls:
        call_id = _id("call")
        call_ids.append(call_id)
        items.append({"type": "function_call", "id": _id("fc"), "call_id": call_id,
                      "name": call.name, "arguments": json.dumps(call.arguments),
                      "status": "completed"})
    items[-1].update(ids)
    return items, call_ids


def output_items(result: dict, parser_name: str = "hermes") -> list[dict]:
    """The episode as Responses output items: each model call's items, its prompt (all the
    tokens before it) and its sampled ids and logprobs on the last of them; each tool
    result as a ``function_call_output`` answering the call before it (a result no call
    asked for, such as the error of a malformed call, answers a call id of its own).

    A harness job whose conversation split (``segments``: its history rewritten between
    calls) is given by its last segment: NeMo RL takes only one chain of prompts each
    extending the last; :func:`run_answer` says how many were left out."""
    turns = result.get("turns")
    if not isinstance(turns, list) or not turns or "prompt_ids" not in result:
        return []  # no model call (a task without one)
    parser = get_parser(parser_name)
    prompt, response = result["prompt_ids"], result["response_ids"]
    logprobs = result["response_logprobs"]
    messages = result.get("messages") or []
    # The model's calls are the last assistant messages: a row's input may hold a
    # conversation's earlier ones, which come first.
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    assistants = assistants[len(assistants) - len(turns):]
    out: list[dict] = []
    if len(assistants) != len(turns):  # ids without the texts (a fabricated trajectory)
        for turn in turns:
            lo, hi = turn["offset"], turn["offset"] + turn["generated"]
            out.append({"type": "message", "id": _id("msg"), "role": "assistant",
                        "status": "completed", "content": [
                            {"type": "output_text", "text": "", "annotations": []}],
                        "prompt_token_ids": prompt + response[:lo],
                        "generation_token_ids": response[lo:hi],
                        "generation_log_probs": logprobs[lo:hi]})
        return out
    bounds = assistants[1:] + [len(messages)]
    for turn, at, end in zip(turns, assistants, bounds):
        lo, hi = turn["offset"], turn["offset"] + turn["generated"]
        items, call_ids = _turn_items(messages[at]["content"], parser, {
            "prompt_token_ids": prompt + response[:lo],
            "generation_token_ids": response[lo:hi],
            "generation_log_probs": logprobs[lo:hi]})
        out += items
        for k, m in enumerate(messages[at + 1:end]):
            if m["role"] == "tool":
                call_id = call_ids[k] if k < len(call_ids) else _id("call")
                out.append({"type": "function_call_output", "call_id": call_id,
                            "output": m["content"]})
            else:
                out.append({"type": "message", "role": m["role"], "content": [
                    {"type": "input_text", "text": m["content"]}]})
    return out


def _trained(output: list[dict]) -> bool:
    """Whether the items hold a sampled token (what NeMo RL trains on)."""
    return any(item.get("generation_token_ids") for item in output)


def response_object(row: dict, job: dict, parser: str = "hermes") -> dict:
    """The Responses object of a finished job: the episode's items when it has one (a
    failed job's too: what its model generated before the failure), ``status`` completed
    only for a job done, and the failure as the Responses ``error`` otherwise."""
    params = row.get("responses_create_params") or {}
    result = job.get("result") or None
    output = output_items(result, parser) if result else []
    turns = (result or {}).get("turns")
    generated = sum(t["generated"] for t in turns) if isinstance(turns, list) else 0
    done = job.get("state") == "done"
    failure = job.get("failure") or {}
    return {
        "id": f"resp_{job['id']}", "object": "response",
        "created_at": float(job.get("created_at") or time.time()),
        "model": params.get("model") or "prorl-farm", "output": output,
        "status": "completed" if done else "failed",
        "error": None if done else {"code": failure.get("kind") or job.get("state"),
                                    "message": (failure.get("message") or "")[:2000]},
        "parallel_tool_calls": bool(params.get("parallel_tool_calls", True)),
        "tool_choice": params.get("tool_choice") or "auto",
        "tools": list(params.get("tools") or []),
        "temperature": (job.get("sampling") or {}).get("temperature"),
        "top_p": (job.get("sampling") or {}).get("top_p"),
        "usage": {"input_tokens": len((result or {}).get("prompt_ids") or []),
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": generated,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": len((result or {}).get("prompt_ids") or []) + generated},
    }


# Gym's record of a /run that produced no rollout (nemo_gym/rollout_collection.py: a result
# carrying ``_ng_failure_class`` goes to the collection's failures sidecar, out of the score;
# ``_ng_failure_terminal`` rows are not dispatched again on resume).
FAILURE_CLASS = "agent_run_error"
# Failures that a second attempt would meet again.
TERMINAL = frozenset({"invalid_instance", "refused"})


def _masked(out: dict, kind: str, reason: str) -> dict:
    """A rollout whose reward is not a measurement, as Gym's verifiers mark one
    (nemo_gym/judge.py's ``judge_failsafe``): ``mask_sample`` true at the top level and in
    ``instance_config``, where NeMo RL reads it (nemo_rl/experience/rollouts.py,
    ``_extract_mask_sample_flags``), ``failure_kind`` and ``failure_reason``. Gym's
    ``BaseVerifyResponse`` requires a float ``reward``: it is 0.0 under the mask, which
    every Gym and NeMo RL consumer leaves out of scores and losses."""
    out["reward"] = 0.0
    out["mask_sample"] = True
    out["instance_config"] = {**(out.get("instance_config") if isinstance(
        out.get("instance_config"), dict) else {}), "mask_sample": True}
    out["failure_kind"] = kind
    out["failure_reason"] = reason[:2000]
    return out


def _failure_record(out: dict, kind: str, reason: str, farm_kind: str) -> dict:
    """A /run that produced no rollout (no token generated), as Gym's agents record one: no
    reward, ``_ng_failure_class`` (Gym's collector writes it to the failures sidecar and
    goes on with the other rows), ``mask_sample``, the failure."""
    out.pop("reward", None)
    out["mask_sample"] = True
    out["failure_kind"] = kind
    out["failure_reason"] = reason[:2000]
    out["_ng_failure_class"] = FAILURE_CLASS
    out["_ng_failure_message"] = reason[:2000]
    if farm_kind in TERMINAL:
        out["_ng_failure_terminal"] = True
    return out


def run_answer(row: dict, job: dict, parser: str = "hermes") -> dict:
    """``/run``'s answer: the row, the ``response``, the ``reward`` and the farm's job id.
    A failed job that generated comes back masked (:func:`_masked`: its tokens are real, its
    reward is not a measurement); one that did not, as a failure record
    (:func:`_failure_record`)."""
    out = dict(row)
    out["response"] = response_object(row, job, parser)
    out["prorl_job_id"] = job["id"]
    dropped = len(((job.get("result") or {}).get("segments")) or [])
    if dropped:
        out["prorl_segments_left_out"] = dropped
    if job.get("state") == "done":
        out["reward"] = float(job["reward"])
        out["mask_sample"] = False
        return out
    failure = job.get("failure") or {"kind": job.get("state") or "failed", "message": ""}
    kind = failure_kind(failure)
    reason = f"{failure['kind']}: {failure.get('message', '')}"
    if _trained(out["response"]["output"]):
        return _masked(out, kind, reason)
    return _failure_record(out, kind, reason, failure["kind"])


def failure_kind(failure: dict) -> str:
    """The farm's failure in Gym's vocabulary (nemo_gym/failure_kinds.py)."""
    if UNREACHABLE in (failure.get("message") or ""):
        return "transport_unreachable"
    return FAILURE_KINDS.get(failure.get("kind"), "agent_run_error")


# How handlers/gym.py says a resources server could not be reached.
UNREACHABLE = "EnvironmentUnreachable"


def refused(row, error: RowError) -> dict:
    """``/run``'s answer to a row the farm cannot take: a failure record (nothing was
    enqueued) whose ``prorl_refused`` is FastAPI's 422 ``detail`` naming each field, so
    one bad row among many fails alone and the collection goes on."""
    out = dict(row) if isinstance(row, dict) else {"row": row}
    reason = f"refused: {error}"
    out["response"] = {"id": f"resp_{uuid.uuid4().hex}", "object": "response",
                       "created_at": time.time(), "output": [], "status": "failed",
                       "error": {"code": "refused", "message": str(error)[:2000]}}
    out["prorl_refused"] = error.detail()
    return _failure_record(out, "agent_run_error", reason, "refused")


def aggregate(verify_responses: list[dict]) -> dict:
    """``/aggregate_metrics``: Gym's ``AggregateMetrics`` (reward mean, max, min, median and
    standard deviation per task and over all rollouts), masked rollouts counted apart and
    left out of every reward figure."""
    scored = [r for r in verify_responses if not r.get("mask_sample")
              and isinstance(r.get("reward"), (int, float))]

    def stats(rewards: list[float]) -> dict:
        if not rewards:
            return {}
        return {"mean/reward": statistics.fmean(rewards), "max/reward": max(rewards),
                "min/reward": min(rewards), "median/reward": statistics.median(rewards),
                "std/reward": statistics.pstdev(rewards)}

    by_task: dict = {}
    for r in scored:
        by_task.setdefault(r.get("_ng_task_index", r.get("_rowidx")), []).append(
            float(r["reward"]))
    groups = [{"_ng_task_index": k, **stats(v)} for k, v in by_task.items()]
    agent = stats([float(r["reward"]) for r in scored])
    agent.update({"rollouts": len(verify_responses), "scored": len(scored),
                  "masked": len(verify_responses) - len(scored)})
    return {"group_level_metrics": groups, "agent_metrics": agent,
            "key_metrics": {k: agent[k] for k in ("mean/reward",) if k in agent}}
