"""A persistent bash session on a pseudo-terminal (ptyprocess).

Each command runs in the same shell (cwd, variables and functions persist), with stdin from
/dev/null so interactive programs get EOF instead of hanging, followed by a marker line
that carries its exit status. A command that runs too long, or prints nothing for too
long, gets SIGINT (Ctrl-C on the terminal), then SIGKILL for its process group; the output
so far comes back with ``timed_out``. If the shell itself stops answering, it is restarted.
Output is capped: the head and the tail are kept and the size is reported.
"""

from __future__ import annotations

import os
import re
import secrets
import select
import signal
import subprocess
import time

from ptyprocess import PtyProcess

from prorl_farm.errors import ToolRejected

HEAD_BYTES = 16 * 1024
TAIL_BYTES = 48 * 1024
SLACK_BYTES = 1024 * 1024
QUIET_ENV = {
    "PS1": "", "PS2": "", "PROMPT_COMMAND": "", "TERM": "dumb", "PAGER": "cat",
    "GIT_PAGER": "cat", "MANPAGER": "cat", "SYSTEMD_PAGER": "", "LESS": "-FRX",
    "DEBIAN_FRONTEND": "noninteractive", "PIP_NO_INPUT": "1", "GIT_TERMINAL_PROMPT": "0",
    "HISTFILE": "/dev/null", "PYTHONUNBUFFERED": "1", "COLUMNS": "500", "LINES": "50",
}


# Job-control chatter of an interactive shell ("[1] 4242" when a job goes to the
# background, "[1]+  Done  sleep 1" when it ends): not the command's output.
_JOB_NOTICE = re.compile(r"^\[\d+\](?: \d+|[+-]? +(?:Done|Exit \d+|Killed|Terminated|Stopped"
                         r"|Running)(?: .*)?)\n", re.MULTILINE)


class _Output:
    """Collects command output, keeping head and tail within the caps."""

    def __init__(self):
        self.buf = bytearray()
        self.head: bytes | None = None
        self.dropped = 0
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.buf += chunk
        self.total += len(chunk)
        if len(self.buf) > HEAD_BYTES + TAIL_BYTES + SLACK_BYTES:
            if self.head is None:
                self.head = bytes(self.buf[:HEAD_BYTES])
                del self.buf[:HEAD_BYTES]
            excess = len(self.buf) - TAIL_BYTES - 4096
            if excess > 0:
                self.dropped += excess
                del self.buf[:excess]

    def text(self, end: int | None = None) -> tuple[str, bool]:
        body = bytes(self.buf[:end] if end is not None else self.buf)
        if self.head is None:
            out = body
        else:
            tail = body[-TAIL_BYTES:]
            omitted = self.dropped + len(body) - len(tail)
            out = self.head + f"\n[... {omitted} bytes omitted ...]\n".encode() + tail
        text = out.decode("utf-8", errors="replace").replace("\r\n", "\n")
        return _JOB_NOTICE.sub("", text), self.head is not None


# Commands that cannot leave bash waiting for more input skip the `bash -n` check (a process
# start, ~1 ms): no quotes, brackets, escapes, heredocs, newlines or compound keywords.
_MAY_CONTINUE = re.compile(r"""['"`\\(){}\[\]<\n]|\b(if|then|for|while|until|case|do|function|"""
                           r"""select)\b|(\||&&)\s*$""")


def ansi_c_quote(text: str) -> str:
    """``text`` as a bash $'...' word: one line, whatever it holds."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == "'":
            out.append("\\'")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


# Reset after every command, on the same input line, so that whatever the agent set, bash
# prints no prompt and runs no prompt command between a command's output and the marker.
_PROMPT_RESET = "PS1=; PS2=; PS4=+; PS0=; PROMPT_COMMAND="


def _syntax_check(command: str):
    if not _MAY_CONTINUE.search(command):
        return None
    return subprocess.run(["bash", "-n"], input=command.encode(), capture_output=True,
                          timeout=10)


class BashSession:
    def __init__(self, cwd: str, env: dict | None = None):
        self.cwd = cwd
        self.env = {**os.environ, **(env or {}), **QUIET_ENV}
        self.proc: PtyProcess | None = None

    def start(self) -> None:
        self.proc = PtyProcess.spawn(["bash", "--noprofile", "--norc", "--noediting"],
                                     cwd=self.cwd, env=self.env, echo=False,
                                     dimensions=(50, 500))
        # No CR before LF (stty acts on the terminal, so not inside the stdin redirect), no
        # history expansion of "!", no "[1]+ Done" chatter in the middle of output.
        # noflsh: Ctrl-C must not discard the marker line queued behind the command.
        os.write(self.proc.fd, b"stty -onlcr noflsh 2>/dev/null\n")
        out = self._run("set +H; set +o notify; true", 10.0, 10.0, restart=False)
        if out["exit_code"] != 0:
            raise ToolRejected(f"bash failed to start: {out['output']!r}")

    def close(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.close(force=True)
            except Exception:  # noqa: BLE001 - best effort on a dying pty
                pass
            self.proc = None

    def run(self, command: str, timeout_s: float = 120.0, no_output_timeout_s: float = 60.0
            ) -> dict:
        """Run ``command``; returns output, exit_code, timed_out, truncated, output_bytes."""
        if not isinstance(command, str) or not command.strip():
            raise ToolRejected("command must be a non-empty string")
        check = _syntax_check(command)
        if check is not None and check.returncode != 0:
            return {"output": check.stderr.decode(errors="replace").replace("bash: -n: ", ""),
                    "exit_code": 2, "timed_out": False, "truncated": False,
                    "output_bytes": 0, "syntax_error": True}
        if self.proc is None or not self.proc.isalive():
            self.close()
            self.start()
        return self._run(command, timeout_s, no_output_timeout_s)

    def _run(self, command: str, timeout_s: float, no_output_timeout_s: float,
             restart: bool = True) -> dict:
        nonce = secrets.token_hex(8)
        marker = re.compile(rb"\r?\n?__PRORL_" + nonce.encode() + rb"_(\d+)__\r?\n")
        # The command is eval'd from one quoted word, so bash never shows a continuation
        # prompt (PS2) for it, and the prompts are reset on the same input line, before bash
        # could print one (PS1, PROMPT_COMMAND) after it. Ctrl-C discards the rest of that
        # line: the second line then prints the marker instead (and nothing otherwise).
        mark = f"printf '\\n__PRORL_{nonce}_%d__\\n' \"$__prorl_rc\""
        reset = f"{{ {_PROMPT_RESET}; }} 2>/dev/null"
        script = (f"__prorl_cmd={ansi_c_quote(command)}; {{ eval \"$__prorl_cmd\"; }} "
                  f"< /dev/null; __prorl_rc=$?; {reset}; __prorl_done=1; {mark}\n"
                  f"__prorl_rc=$?; {reset}; "
                  f"if [ -z \"$__prorl_done\" ]; then {mark}; fi; __prorl_done=\n")
        fd = self.proc.fd
        os.write(fd, script.encode())
        out = _Output()
        start = last = time.monotonic()
        timed_out, reason, stage = False, "", 0
        while True:
            now = time.monotonic()
            if stage == 0 and (now - start > timeout_s or now - last > no_output_timeout_s):
                timed_out = True
                reason = "timeout" if now - start > timeout_s else "no output"
                os.write(fd, b"\x03")  # Ctrl-C: SIGINT to the foreground process group
                stage, stage_at = 1, now
            elif stage == 1 and now - stage_at > 3.0:
                self._kill_foreground()
                stage, stage_at = 2, now
            elif stage == 2 and now - stage_at > 3.0:
                return self._restarted(out, restart, "bash does not answer", timed_out=True,
                                       timeout_reason=reason)
            ready, _, _ = select.select([fd], [], [], 0.1)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # the shell died (e.g. `exit`)
                return self._restarted(out, restart, "bash died at start",
                                       timed_out=timed_out)
            last = time.monotonic()
            scan_from = max(0, len(out.buf) - 64)
            out.add(chunk)
            m = marker.search(out.buf, max(0, min(scan_from, len(out.buf) - len(chunk) - 64)))
            if m:
                text, truncated = out.text(m.start())
                result = {"output": text, "exit_code": int(m.group(1)),
                          "timed_out": timed_out, "truncated": truncated,
                          "output_bytes": out.total - (len(out.buf) - m.start())}
                if timed_out:
                    result["timeout_reason"] = reason
                return result

    def _restarted(self, out: _Output, restart: bool, why: str, **fields) -> dict:
        """The answer of a command whose shell is gone or does not answer: what it printed,
        and a new shell (``restart``; else ToolRejected: the session's first command)."""
        text, truncated = out.text()
        if not restart:
            raise ToolRejected(f"{why}: {text[-500:]!r}") from None
        self.close()
        self.start()
        return {"output": text, "exit_code": -1, "truncated": truncated,
                "output_bytes": out.total, **fields, "session_restarted": True}

    def _kill_foreground(self) -> None:
        """SIGKILL the terminal's foreground process group, unless it is the shell."""
        try:
            pgid = os.tcgetpgrp(self.proc.fd)
        except OSError:
            return
        if pgid > 0 and pgid != self.proc.pid:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
