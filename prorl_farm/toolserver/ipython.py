"""An IPython kernel through jupyter_client, started on first use (IPC transport: no TCP
ports, so sandboxes sharing a network never collide)."""

from __future__ import annotations

import os
import queue
import re
import time

from prorl_farm.errors import ToolRejected

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MAX_TEXT = 64 * 1024


def _cap(text: str) -> str:
    if len(text) <= MAX_TEXT:
        return text
    half = MAX_TEXT // 2
    return f"{text[:half]}\n[... {len(text) - MAX_TEXT} characters omitted ...]\n{text[-half:]}"


class IPythonSession:
    def __init__(self, cwd: str, runtime_dir: str, env: dict | None = None):
        self.cwd = cwd
        self.runtime_dir = runtime_dir
        self.env = env or {}
        self.km = None
        self.kc = None

    def start(self) -> None:
        from jupyter_client import KernelManager

        os.makedirs(self.runtime_dir, exist_ok=True)
        self.km = KernelManager(kernel_name="python3", transport="ipc",
                                ip=os.path.join(self.runtime_dir, "kernel"),
                                connection_file=os.path.join(self.runtime_dir, "kernel.json"))
        env = {**os.environ, **self.env, "JUPYTER_RUNTIME_DIR": self.runtime_dir}
        self.km.start_kernel(cwd=self.cwd, env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=60)
        except RuntimeError as e:
            self.close()
            raise ToolRejected(f"IPython kernel did not start: {e}") from e

    def pids(self) -> set[int]:
        """The kernel's process, while it runs."""
        try:
            proc = self.km.provisioner.process if self.km is not None else None
        except AttributeError:
            proc = None
        return {proc.pid} if proc is not None else set()

    def close(self) -> None:
        if self.kc is not None:
            self.kc.stop_channels()
            self.kc = None
        if self.km is not None:
            try:
                self.km.shutdown_kernel(now=True)
            except Exception:  # noqa: BLE001 - best effort on a dying kernel
                pass
            self.km = None

    def run(self, code: str, timeout_s: float = 120.0) -> dict:
        if not isinstance(code, str):
            raise ToolRejected("code must be a string")
        if self.km is None or not self.km.is_alive():
            self.close()
            self.start()
        kc = self.kc
        # Drop messages left over from an earlier, interrupted call.
        while True:
            try:
                kc.get_iopub_msg(timeout=0)
            except queue.Empty:
                break
        msg_id = kc.execute(code, store_history=True, allow_stdin=False)
        out = {"stdout": "", "stderr": "", "results": [], "error": None, "timed_out": False}
        deadline = time.monotonic() + timeout_s
        interrupted_at = None
        while True:
            now = time.monotonic()
            if interrupted_at is None and now > deadline:
                self.km.interrupt_kernel()
                out["timed_out"] = True
                interrupted_at = now
            elif interrupted_at is not None and now - interrupted_at > 5:
                self.close()  # the interrupt did not take: start afresh next time
                out["kernel_restarted"] = True
                break
            try:
                msg = kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content.get("name", "stdout")] = out.get(content.get("name"), "") + \
                    content.get("text", "")
            elif kind in ("execute_result", "display_data"):
                text = content.get("data", {}).get("text/plain")
                if text is not None:
                    out["results"].append(text)
            elif kind == "error":
                out["error"] = {"ename": content.get("ename"), "evalue": content.get("evalue"),
                                "traceback": ANSI.sub("", "\n".join(content.get("traceback", [])))}
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        out["stdout"], out["stderr"] = _cap(out["stdout"]), _cap(out["stderr"])
        return out
