"""The tools an agent is offered: their JSON schemas (rendered into the prompt by the chat
template) and how each call runs through the job's sandbox ``ToolConnection``.

``bash`` and ``python`` (IPython) run code; ``str_replace_editor`` views and edits files
(view / create / str_replace / insert / undo_edit); ``submit`` ends the episode (handlers
that take a final answer or a final program read its arguments). Every result comes back as
text, its head and tail kept within a size.
"""

from __future__ import annotations

from dataclasses import dataclass

from prorl_farm.errors import FarmError, ToolRejected

SCHEMAS: dict[str, dict] = {
    "bash": {"type": "function", "function": {
        "name": "bash", "description": "Run a bash command in the workspace (a persistent "
        "shell: the working directory and variables stay between calls).",
        "parameters": {"type": "object", "required": ["command"], "properties": {
            "command": {"type": "string", "description": "the command to run"}}}}},
    "python": {"type": "function", "function": {
        "name": "python", "description": "Run Python code in a persistent IPython session; "
        "the value of the last expression and anything printed come back.",
        "parameters": {"type": "object", "required": ["code"], "properties": {
            "code": {"type": "string", "description": "the code to run"}}}}},
    "str_replace_editor": {"type": "function", "function": {
        "name": "str_replace_editor", "description": "View, create and edit files in the "
        "workspace. view: a file with line numbers (view_range [start, end]); create: a new "
        "file with file_text; str_replace: replace old_str (which must occur exactly once) "
        "with new_str; insert: new_str after line insert_line; undo_edit: revert the last "
        "edit of the file.",
        "parameters": {"type": "object", "required": ["command", "path"], "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert",
                                                   "undo_edit"]},
            "path": {"type": "string"}, "file_text": {"type": "string"},
            "old_str": {"type": "string"}, "new_str": {"type": "string"},
            "insert_line": {"type": "integer"},
            "view_range": {"type": "array", "items": {"type": "integer"}}}}}},
    "submit": {"type": "function", "function": {
        "name": "submit", "description": "Submit your final answer (and end the episode).",
        "parameters": {"type": "object", "properties": {
            "answer": {"type": "string", "description": "the final answer, if the task asks "
                       "for one"}}}}},
}


class BadArguments(FarmError, ValueError):
    """A call whose arguments do not fit the tool (reported to the model, counted)."""


def truncate(text: str, limit: int) -> str:
    """Head and tail of ``text`` within ``limit`` characters, saying what was cut."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters omitted ...]\n{text[-tail:]}"


def _str(args: dict, key: str, required: bool = True) -> str | None:
    value = args.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise BadArguments(f"'{key}' must be a string")
    return value


def _full(out: dict) -> str:
    """What the agent is told when its workspace is past its size limit."""
    full = out.get("workspace_full")
    if not full:
        return ""
    return (f"\n[the workspace is over its limit of {full['limit_mb']} MiB "
            f"({full['used_mb']} MiB): what wrote was stopped; remove files]")


@dataclass
class ToolRunner:
    """Runs calls of the offered tools through a sandbox's ToolConnection."""

    client: object  # ToolConnection, or None for tool-less episodes
    timeout_s: float = 60.0

    def run(self, name: str, args: dict, abort_hook=None, timeout_s: float | None = None
            ) -> tuple[str, bool]:
        """(observation text, ok). Tool-side errors come back as text with ok False;
        BadArguments propagates (a malformed call)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            if name == "bash":
                out = self.client.call("bash", abort_hook=abort_hook,
                                       command=_str(args, "command"), timeout_s=timeout,
                                       no_output_timeout_s=timeout)
                text = out["output"]
                if out.get("timed_out"):
                    text += f"\n[timed out after {timeout:g} s]"
                if out.get("session_restarted"):
                    text += "\n[the shell died and was restarted]"
                text += f"\n[exit code {out['exit_code']}]"
                return text + _full(out), out["exit_code"] == 0 and "workspace_full" not in out
            if name == "python":
                out = self.client.call("ipython", abort_hook=abort_hook,
                                       code=_str(args, "code"), timeout_s=timeout)
                parts = [out.get("stdout", ""), out.get("stderr", "")]
                parts += [str(r) for r in out.get("results") or []]
                if out.get("error"):
                    parts.append(str(out["error"]))
                if out.get("timed_out"):
                    parts.append(f"[timed out after {timeout:g} s]")
                return ("\n".join(p for p in parts if p) + _full(out),
                        not out.get("error") and "workspace_full" not in out)
            if name == "str_replace_editor":
                return self._edit(args, abort_hook), True
        except ToolRejected as e:
            return f"error: {e}", False
        raise BadArguments(f"unknown tool {name!r}")

    def _edit(self, args: dict, abort_hook) -> str:
        command = _str(args, "command")
        path = _str(args, "path")
        call = {"view": "view", "create": "create", "str_replace": "str_replace",
                "insert": "insert", "undo_edit": "undo"}.get(command)
        if call is None:
            raise BadArguments(f"unknown command {command!r}")
        kw: dict = {"path": path}
        if command == "view":
            rng = args.get("view_range")
            if rng is not None:
                if (not isinstance(rng, list) or len(rng) != 2
                        or not all(isinstance(x, int) for x in rng)):
                    raise BadArguments("'view_range' must be [start, end]")
                kw.update(start_line=rng[0], end_line=rng[1])
        elif command == "create":
            kw.update(content=_str(args, "file_text"), overwrite=True)
        elif command == "str_replace":
            kw.update(old_str=_str(args, "old_str"), new_str=_str(args, "new_str"))
        elif command == "insert":
            line = args.get("insert_line")
            if not isinstance(line, int):
                raise BadArguments("'insert_line' must be an integer")
            kw.update(line=line, text=_str(args, "new_str"))
        out = self.client.call(call, abort_hook=abort_hook, **kw)
        if command == "view":
            if out.get("type") == "directory":
                return "\n".join(out.get("entries", []))
            return out["content"] + ("\n[truncated]" if out.get("truncated") else "")
        if command == "create":
            return f"created {out.get('path', path)}"
        if command == "undo_edit":
            return f"restored {out.get('path', path)}"
        return f"edited {out.get('path', path)} at line {out.get('line')}"
