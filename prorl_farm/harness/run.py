"""Running a harness in the job's sandbox: its gateway opened under a key of this job, the
harness executed with the gateway's variables, stopped at a limit, its capture made the
RUN result."""

from __future__ import annotations

import time

from prorl_farm.agent.loop import CONTEXT_LENGTH, AgentLimits
from prorl_farm.agent.parsers import get_parser
from prorl_farm.agent.trajectory import load_chat_tokens
from prorl_farm.context import JobContext
from prorl_farm.errors import HarnessFailed, StageTimeout
from prorl_farm.gateway.capture import Capture
from prorl_farm.gateway.server import JobGateway, Sampled, UnixGatewayServer
from prorl_farm.harness.answers import (
    CONNECTS_FILE,
    MAX_ANSWER_FILE,
    answer_file,
    answer_rules,
    connections,
    take_answer,
)
from prorl_farm.harness.presets import (
    MODEL_ENV,
    PRESETS,
    PROMPT_FILE,
    PROMPT_FILE_ENV,
    needed_context,
)
from prorl_farm.llm.session import BackendSession, turn_seed
from prorl_farm.sandbox.abstract import (
    GATEWAY_SOCKET,
    INSIDE_HARNESSES,
    gateway_dir,
    gateway_env,
)
from prorl_farm.sandbox.connection import ToolConnection

EXEC_NAME = "harness"
TAIL_CHARS = 64 * 1024  # of the harness's stdout and stderr, kept with the job


def _tail(text: str) -> str:
    return text if len(text) <= TAIL_CHARS else text[-TAIL_CHARS:]


def command_line(options: dict, prompt: str, model: str, max_turns: int = 100
                 ) -> tuple[list[str], str | None, str | None]:
    """(argv, stdin, prompt file text) for a harness with these options."""
    preset = PRESETS.get(options.get("preset") or "")
    mode = options.get("prompt") or (preset.prompt if preset else "stdin")
    if preset is not None:
        values = {"env": f"{INSIDE_HARNESSES}/{preset.env}", "model": model,
                  "prompt": prompt, "prompt_file": PROMPT_FILE, "max_turns": max_turns}
        argv = [a.format(**values) for a in preset.argv]
    else:  # the prompt is $1 of the command
        argv = ["bash", "-c", options["command"], "harness"]
        if mode == "argument":
            argv.append(prompt)
    return (argv, prompt if mode == "stdin" else None,
            prompt if mode == "file" else None)


def harness_env(options: dict, sandbox: dict, key: str, model: str) -> dict[str, str]:
    preset = PRESETS.get(options.get("preset") or "")
    gateway = gateway_env(sandbox["ip"])
    own = {k: v.format(key=key, model=model) for k, v in (preset.variables if preset
                                                           else {}).items()}
    env = {"HOME": "/tmp", "TERM": "dumb", **own,
           **{v["name"]: v["value"] for v in options.get("env", [])}}
    env.update(gateway, OPENAI_API_BASE=gateway["OPENAI_BASE_URL"], OPENAI_API_KEY=key,
               ANTHROPIC_API_KEY=key, **{MODEL_ENV: model, PROMPT_FILE_ENV: PROMPT_FILE})
    return env


class _Stopper:
    """Ends the harness from another thread (a limit reached at the gateway, a backend
    fault): the tool server's ``kill`` of the named exec, on a connection of its own."""

    def __init__(self, socket: str):
        self.socket = socket
        self.reason = ""
        self.fault: BaseException | None = None

    def __call__(self, reason: str, fault: BaseException | None = None) -> None:
        if not self.reason:
            self.reason, self.fault = reason, fault
        conn = ToolConnection(self.socket)
        try:
            conn.call("kill", name=EXEC_NAME)
        except Exception:  # noqa: BLE001 - the sandbox may be gone: nothing to stop then
            pass
        finally:
            conn.close()


def run_harness(ctx: JobContext, options: dict, prompt: str) -> dict:
    """Run the harness of ``options`` on ``prompt`` in the job's sandbox; the RUN result."""
    inst = ctx.instance
    sandbox = ctx.state.get("sandbox")
    if not sandbox:
        raise HarnessFailed("the job has no sandbox to run its harness in")
    limits = AgentLimits.from_job(inst, ctx.sampling, context_length=max(
        CONTEXT_LENGTH, needed_context(options)))
    session = BackendSession.for_job(ctx)
    stopper = _Stopper(sandbox["socket"])

    def sampler(ids: list[int], sampling: dict) -> Sampled:
        try:
            got = session.generate(ids, dict(sampling, seed=turn_seed(ctx, job.sampled)))
        except Exception as e:  # a backend fault, the deadline, a cancel: RUN reports it
            stopper("error", e)
            raise
        b = got.backend
        return Sampled(got.generation, b.id, b.policy_version, b.logprobs_mode, got.versions)

    with session:
        first, chat = session.first_backend(load_chat_tokens)
        capture = Capture(chat, get_parser(inst["parser"]),
                          context_length=session.context_limit(limits.context_length))
        job = JobGateway(ctx.job_id, capture, sampler, dict(ctx.sampling), first.model,
                         max_tokens=limits.max_tokens_per_turn, max_calls=limits.max_turns,
                         max_total_tokens=limits.max_total_tokens, on_end=stopper)
        sock = gateway_dir(sandbox["workspace"]) / GATEWAY_SOCKET
        sock.unlink(missing_ok=True)  # an earlier attempt's
        server = UnixGatewayServer(str(sock))
        key = server.open_job(job)
        t0 = time.monotonic()
        out: dict | None = None
        try:
            out = _execute(ctx, options, sandbox, key, first.model, prompt,
                           limits.max_turns or 100, capture.context_length or CONTEXT_LENGTH)
        finally:
            server.close_job(key)
            server.stop()
            if out is None:  # cancelled, or the sandbox failed: nothing may run on
                stopper("aborted")
        job.on_end = None  # it is over: a straggling call is refused, nothing more to stop
        job.end(stopper.reason or "exited")
        return _result(ctx, options, job, stopper, out, time.monotonic() - t0)


def _setup_files(options: dict, sandbox: dict, model: str, context: int) -> dict[str, str]:
    preset = PRESETS.get(options.get("preset") or "")
    if preset is None or preset.setup is None:
        return {}
    base_url = gateway_env(sandbox["ip"])["OPENAI_BASE_URL"]
    return preset.setup({"model": model, "base_url": base_url, "context": context})


def _execute(ctx: JobContext, options: dict, sandbox: dict, key: str, model: str,
             prompt: str, max_turns: int, context: int) -> dict:
    argv, stdin, prompt_file = command_line(options, prompt, model, max_turns)
    if options.get("audit_connections"):
        argv = ["strace", "-f", "-qq", "-e", "trace=connect", "-o", CONNECTS_FILE, *argv]
    conn = ToolConnection(sandbox["socket"])
    try:
        files = dict(_setup_files(options, sandbox, model, context))
        if prompt_file is not None:
            files[PROMPT_FILE] = prompt_file
        for path, text in files.items():
            wrote = conn.call("exec", abort_hook=ctx.on_abort, timeout_s=30,
                              argv=["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"',
                                    "sh", path], stdin=text)
            if wrote["exit_code"] != 0:
                raise HarnessFailed(f"could not write {path}: {wrote['stderr']}")
        limit = min(options.get("time_limit_s", 1800.0), max(0.1, ctx.remaining_s))
        out = conn.call("exec", abort_hook=ctx.on_abort, timeout_s=limit, argv=argv,
                        stdin=stdin, env=harness_env(options, sandbox, key, model),
                        name=EXEC_NAME)
        if options.get("audit_connections"):
            got = conn.call("exec", abort_hook=ctx.on_abort, timeout_s=30,
                            argv=["cat", CONNECTS_FILE])
            out["connections"] = connections(got["stdout"] if got["exit_code"] == 0
                                             else None, sandbox["ip"])
        path = answer_file(options)
        if path and "output_file" in answer_rules(options) and not out["timed_out"]:
            got = conn.call("exec", abort_hook=ctx.on_abort, timeout_s=30,
                            argv=["head", "-c", str(MAX_ANSWER_FILE), "--", path])
            out["answer_file"] = got["stdout"] if got["exit_code"] == 0 else None
    finally:
        conn.close()
    out["limit_s"] = limit
    return out


def _result(ctx: JobContext, options: dict, job: JobGateway, stopper: _Stopper, out: dict,
            duration_s: float) -> dict:
    captured = job.result()
    segments = captured["segments"]
    last = segments[-1] if segments else {}
    replied = last.get("messages", [{}])[-1] if last else {}
    if out["exit_code"] != 0 or stopper.reason or out["timed_out"]:
        ended = "timeout" if out["timed_out"] else (stopper.reason or
                                                    f"exit status {out['exit_code']}")
        answer = {"rule": None, "text": "", "reason": f"the harness did not finish: {ended}"}
    else:
        answer = take_answer(answer_rules(options), replied, job.capture.parser, out)
    end_reason = stopper.reason or ("answered" if answer["rule"] else "exited")
    if out["timed_out"]:
        end_reason = "timeout"
    result = {**last, "capture": captured["capture"], "answer": answer,
              "stats": {"end_reason": end_reason, "turns": job.sampled,
                        "generated_tokens": job.generated, "harness_s": round(duration_s, 3)},
              "harness": {"preset": options.get("preset"), "exit_code": out["exit_code"],
                          "signal": out["signal"], "timed_out": out["timed_out"],
                          "stdout_tail": _tail(out["stdout"]),
                          "stderr_tail": _tail(out["stderr"])}}
    if "connections" in out:
        result["harness"]["connections"] = out["connections"]
    if len(segments) > 1:
        result["segments"] = segments[:-1]
    partial = result if segments else None
    if isinstance(stopper.fault, StageTimeout):  # keep what was captured
        raise StageTimeout(str(stopper.fault), partial=partial) from stopper.fault
    if stopper.fault is not None:
        raise stopper.fault
    ctx.check()
    if out["timed_out"]:
        raise StageTimeout(f"the harness ran past its time limit ({out['limit_s']:.0f} s)",
                           partial=partial)
    if stopper.reason:  # a limit ended the episode: the harness was stopped, as planned
        return result
    if out["exit_code"] != 0:
        raise HarnessFailed(f"the harness exited with status {out['exit_code']}: "
                            f"{_tail(out['stderr'] or out['stdout'])[-1000:]}", partial=partial)
    if not segments:
        raise HarnessFailed("the harness exited without a model call that sampled: "
                            f"{_tail(out['stderr'] or out['stdout'])[-1000:]}",
                            partial={"harness": result["harness"],
                                     "capture": captured["capture"]})
    return result
