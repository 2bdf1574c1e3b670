"""A harness's answer for an answer task, by its preset's rules (ANSWER_RULES), and the
connections an audited run made."""

from __future__ import annotations

import json
import re

from prorl_farm.harness.presets import FINAL_ANSWER_TOOLS, PRESETS
from prorl_farm.sandbox.abstract import GATEWAY_PORT

MAX_ANSWER_FILE = 1 << 20
CONNECTS_FILE = "/tmp/prorl-connects.txt"
_CONNECT = re.compile(r"connect\(\d+, \{sa_family=(\w+)(.*?)\}, \d+\)")


def connections(trace: str | None, ip: str) -> dict:
    """The connect() calls of a strace log, sorted: to the gateway's door (the sandbox's
    address, its port), to other internet addresses (``outside``: each call as strace wrote
    it), to local sockets (Unix, netlink)."""
    if trace is None:
        return {"audited": False, "reason": "no strace log (is strace in the sandbox?)"}
    door = f'sin_port=htons({GATEWAY_PORT}), sin_addr=inet_addr("{ip}")'
    gateway, outside, local = 0, [], 0
    for line in trace.splitlines():
        match = _CONNECT.search(line)
        if match is None:
            continue
        family, rest = match.groups()
        if family not in ("AF_INET", "AF_INET6"):
            local += 1
        elif door in rest:
            gateway += 1
        else:
            outside.append(line.strip()[:300])
    return {"audited": True, "gateway": gateway, "outside": outside, "local": local}


def answer_rules(options: dict) -> tuple[str, ...]:
    """The rules that take a harness's answer, in order: the instance's, else its preset's,
    else the last assistant text or a final_answer-style call."""
    if options.get("answer"):
        return (options["answer"],)
    preset = PRESETS.get(options.get("preset") or "")
    return preset.answer if preset else ("last_text", "final_answer_tool")


def answer_file(options: dict) -> str:
    preset = PRESETS.get(options.get("preset") or "")
    return options.get("answer_file") or (preset.answer_file if preset else "")


def _harness_json(stdout: str) -> tuple[str | None, str]:
    """(the answer, or None and why) from the JSON result a harness printed last."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("type") == "result":
            if doc.get("is_error") or doc.get("subtype") not in (None, "success"):
                return None, (f"the harness reported an error ({doc.get('subtype')}): "
                              f"{str(doc.get('result'))[:300]}")
            if not isinstance(doc.get("result"), str):
                return None, "the harness's JSON result has no text result"
            return doc["result"], ""
    return None, "the harness printed no JSON result"


def take_answer(rules: tuple[str, ...], replied: dict, parser, out: dict) -> dict:
    """The harness's answer by the first rule that gives one: {rule, text}; none gives one:
    {rule: None, text: "", reason}."""
    content = replied.get("content", "") if replied.get("role") == "assistant" else None
    parsed = parser.parse(content) if content is not None else None
    why = []
    for rule in rules:
        text = None
        if rule == "last_text":
            if content is None:
                why.append("last_text: the conversation does not end with a model reply")
            elif parsed.any:
                why.append("last_text: the last reply calls a tool")
            else:
                text = content
        elif rule == "final_answer_tool":
            final = [c for c in (parsed.calls if parsed else [])
                     if c.name in FINAL_ANSWER_TOOLS]
            if not final:
                why.append("final_answer_tool: the last reply calls no "
                           + "/".join(FINAL_ANSWER_TOOLS))
            else:
                args = final[-1].arguments
                value = args.get("answer", next(iter(args.values())) if len(args) == 1
                                 else json.dumps(args))
                text = value if isinstance(value, str) else json.dumps(value)
        elif rule == "harness_json":
            text, reason = _harness_json(out.get("stdout", ""))
            if text is None:
                why.append(f"harness_json: {reason}")
        elif rule == "output_file":
            text = out.get("answer_file")
            if text is None:
                why.append("output_file: the harness left no answer file")
        if text is not None:
            return {"rule": rule, "text": text}
    return {"rule": None, "text": "", "reason": "; ".join(why) or "no rule"}
