"""Evaluation the agent cannot steer: a grader runs in a fresh sandbox that holds only the
files it is given, through the ``exec`` tool (an argv in a clean environment: no shell
state, no user site, no PYTHON* variables, no script-directory imports), and its verdict is
the exit status and output that the tool server itself collected, never anything read back
from the agent's sandbox.

Handlers use it in EVAL: take what the agent produced with
:meth:`SandboxManager.snapshot` (regular files only, links not followed), stop the agent's
sandbox (its slot is free before the grader's is taken), add the hidden tests, run.
"""

from __future__ import annotations

import json

from prorl_farm.context import JobContext
from prorl_farm.errors import GradingError
from prorl_farm.sandbox.abstract import Limits, SandboxSpec
from prorl_farm.sandbox.connection import ToolConnection

# A grader needs few processes: a fork bomb in the program under test stops here.
GRADER_LIMITS = Limits(processes=64)


def run_isolated(ctx: JobContext, files: dict[str, str | bytes], argv: list[str],
                 timeout_s: float, stdin: str | None = None,
                 env: dict[str, str] | None = None, limits: Limits = GRADER_LIMITS,
                 ro_paths: dict[str, str] | None = None) -> dict:
    """Run ``argv`` in a fresh sandbox holding only ``files`` (and ``ro_paths``, read-only:
    an environment); returns the ``exec`` result (exit_code, signal, stdout, stderr,
    timed_out). The sandbox is gone afterwards."""
    sandboxes = ctx.sandboxes
    sandbox = sandboxes.start(SandboxSpec(workspace_files=files, limits=limits,
                                          ro_paths=dict(ro_paths or {})), ctx.job_id,
                              ctx.requeues, ctx)
    client = ToolConnection(sandbox.socket)
    try:
        timeout = max(0.1, min(timeout_s, ctx.remaining_s))
        return client.call("exec", abort_hook=ctx.on_abort, argv=argv, timeout_s=timeout,
                           stdin=stdin, env=env or {})
    finally:
        client.close()
        sandboxes.stop(sandbox)


def jail_spec(ctx: JobContext) -> dict:
    """What a grader's spec says of its jail's scratch: ``shm_mb``, the size of its
    /dev/shm (memory), ``grade_scratch_mb`` cut to the node's budget
    (config.Settings.memory_scratch_mb); ``disk_mb``, what a program may write to disk (its
    /tmp, its writable binds), half the sandbox's workspace bound, which the grader holds it
    to itself: a program that fills the disk fails its tests, and the grader, within the
    bound, gives its verdict."""
    settings = getattr(ctx, "settings", None)
    if settings is None:
        return {"shm_mb": 64, "disk_mb": 2048}
    return {"shm_mb": settings.memory_scratch_mb()[1],
            "disk_mb": max(8, settings.sandbox_workspace_mb // 2)}


def tagged_verdict(stdout: str, nonce: str) -> dict | None:
    """A grader's verdict: the JSON on its last stdout line that starts with ``nonce`` (which
    only the grader read, from its stdin, before anything under test ran); None if there is
    none or it does not parse."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce + " "):
            try:
                verdict = json.loads(line[len(nonce) + 1:])
            except ValueError:
                return None
            return verdict if isinstance(verdict, dict) else None
    return None


def required_verdict(out: dict, nonce: str, grader: str) -> dict:
    """The grader's verdict from an ``exec`` result, or :class:`GradingError` if it gave
    none, or says that it could not grade (``{"error": ...}``)."""
    verdict = tagged_verdict(out["stdout"], nonce)
    if verdict is None:
        why = "timed out" if out["timed_out"] else f"exit status {out['exit_code']}"
        if out.get("workspace_full"):
            full = out["workspace_full"]
            why = (f"the code under test filled the workspace past its limit of "
                   f"{full['limit_mb']} MiB ({full['used_mb']} MiB): it was stopped")
        raise GradingError(f"the {grader} gave no verdict ({why}): {out['stderr'][-1500:]}")
    if "error" in verdict:
        raise GradingError(f"the {grader} could not grade: {verdict['error']}")
    return verdict


def agent_files(ctx: JobContext) -> dict[str, bytes]:
    """What the agent left in its workspace (from INIT's ``sandbox`` state), then stop its
    sandbox: nothing of it runs while the grader does."""
    sandbox = ctx.state["sandbox"]
    try:
        return ctx.sandboxes.snapshot(sandbox)
    finally:
        ctx.sandboxes.stop(sandbox)
