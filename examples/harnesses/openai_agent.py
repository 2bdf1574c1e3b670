"""A plain tool-calling agent on the ``openai`` SDK: what many teams' own harnesses look
like, and the farm's ``openai-agent`` preset.

    python openai_agent.py PROMPT_FILE

It reads its task from PROMPT_FILE, offers the model a ``bash`` and a ``python`` tool, runs
each call in the current directory, and stops at the first reply without a tool call (its
final answer, printed) or after MAX_STEPS. It knows nothing of the farm: the endpoint, key
and model come from OPENAI_BASE_URL, OPENAI_API_KEY and PRORL_MODEL (or OPENAI_MODEL), as
any OpenAI client would take them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai

MAX_STEPS = int(os.environ.get("AGENT_MAX_STEPS", "30"))
TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a bash command in the working directory.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "python", "description": "Run a Python program; its stdout is returned.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                       "required": ["code"]}}},
]


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except ValueError as e:
        return f"error: the arguments are not JSON: {e}"
    if name == "bash":
        argv = ["bash", "-c", str(args.get("command", ""))]
    elif name == "python":
        argv = [sys.executable, "-c", str(args.get("code", ""))]
    else:
        return f"error: no tool {name!r}"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "error: timed out after 120 s"
    out = done.stdout + done.stderr
    return (out[-8000:] or "(no output)") + f"\n[exit status {done.returncode}]"


def main() -> int:
    task = open(sys.argv[1]).read()
    model = os.environ.get("PRORL_MODEL") or os.environ.get("OPENAI_MODEL", "default")
    client = openai.OpenAI()
    messages = [{"role": "system", "content": "You are a careful assistant with tools."},
                {"role": "user", "content": task}]
    for _ in range(MAX_STEPS):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(message.content or "")
            return 0
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    print("step limit reached", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
