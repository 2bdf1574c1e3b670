"""Agent harnesses as the agent of a job: a program of its own (mini-SWE-agent, a script on
the ``openai`` SDK, a coding CLI) run unchanged in the job's sandbox, its model calls served
by the job's gateway.

An instance names one in its ``agent`` field (:class:`HarnessOptions`): a preset, or a
command run with ``bash -c`` in the workspace. RUN then

1. pins the job to a backend (the sticky session every turn of the built-in loop uses) and
   opens a :class:`~prorl_farm.gateway.server.JobGateway` on the sandbox's gateway socket
   under a new key of this job only;
2. runs the harness (the tool server's ``exec``: a clean environment, its own session)
   with ``OPENAI_BASE_URL``/``OPENAI_API_BASE``/``ANTHROPIC_BASE_URL`` at the sandbox's
   loopback relay, the key in ``OPENAI_API_KEY``/``ANTHROPIC_API_KEY``, the model's name in
   ``PRORL_MODEL``, and the prompt as its argument, a file (``PRORL_PROMPT_FILE``) or its
   stdin;
3. ends when the harness exits, when a limit ends the episode (the gateway refuses the
   call that passes it; RUN kills the harness and goes on: EVAL grades what it left), when
   its ``time_limit_s`` or the job's deadline passes (the job fails ``timeout``, keeping
   what was captured), or when the job is cancelled. The key dies with the gateway, and
   the harness's processes with its session.

The result is the last segment of the capture as the trajectory (what EVAL grades: its
final answer), earlier segments in ``segments``, the capture stats, and the harness's exit
status and output tails. A harness that exits non-zero, or without a sampled call, fails
the job ``harness_error`` (never a zero reward).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from marshmallow import RAISE, Schema, ValidationError, fields, validate, validates_schema

from prorl_farm.agent.loop import AgentLimits
from prorl_farm.agent.parsers import get_parser
from prorl_farm.agent.trajectory import load_chat_tokens
from prorl_farm.context import JobContext
from prorl_farm.errors import HarnessFailed, StageTimeout
from prorl_farm.gateway.capture import Capture
from prorl_farm.gateway.server import JobGateway, Sampled, UnixGatewayServer
from prorl_farm.llm.session import BackendSession, turn_seed
from prorl_farm.sandbox.abstract import (
    GATEWAY_SOCKET,
    INSIDE_HARNESSES,
    gateway_dir,
    gateway_env,
)
from prorl_farm.sandbox.connection import ToolConnection

PROMPT_FILE = "/tmp/prorl-prompt.txt"
# What a harness is told besides the SDKs' own variables: the model's name, the prompt file.
MODEL_ENV, PROMPT_FILE_ENV = "PRORL_MODEL", "PRORL_PROMPT_FILE"
TAIL_CHARS = 4000  # of the harness's stdout and stderr, kept in the result
EXEC_NAME = "harness"
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Preset:
    """A harness the farm knows how to install and run."""

    env: str  # its environment under PRORL_HARNESS_DIR
    argv: tuple[str, ...]  # {env} {prompt} {prompt_file} {model} filled in
    prompt: str  # how the prompt is handed over: argument, file or stdin
    packages: tuple[str, ...]  # what `prorl-farm harness install` puts in the environment
    variables: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # env-relative -> checkout-relative
    about: str = ""


PRESETS: dict[str, Preset] = {
    "mini-swe-agent": Preset(
        "mini-swe-agent",
        ("{env}/bin/python", "-m", "minisweagent.run.mini", "--yolo", "--exit-immediately",
         "--cost-limit", "0", "--model", "openai/{model}", "--output",
         "/tmp/mini-swe-agent/last.traj.json", "--task", "{prompt}"),
        "argument", ("mini-swe-agent==2.4.6",),
        {"MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1",
         "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mini-swe-agent",
         "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        about="mini-SWE-agent (PyPI mini-swe-agent), its `mini` command non-interactive: "
              "bash tool calls through litellm's OpenAI client"),
    "openai-agent": Preset(
        "openai-agent", ("{env}/bin/python", "{env}/share/openai_agent.py", "{prompt_file}"),
        "file", ("openai>=1.40", "anthropic>=0.40"), files={"share/openai_agent.py":
                                         "examples/harnesses/openai_agent.py"},
        about="examples/harnesses/openai_agent.py: a tool-calling loop on the openai SDK "
              "(bash and python tools, a final answer without a call); its environment has "
              "the anthropic SDK too, for commands of your own"),
}

_ENV_NAME = validate.Regexp(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvVar(Schema):
    class Meta:
        unknown = RAISE

    name = fields.String(required=True, validate=_ENV_NAME)
    value = fields.String(required=True, validate=validate.Length(max=100_000))


class HarnessOptions(Schema):
    """An instance's ``agent``: the harness that plays the policy's part."""

    class Meta:
        unknown = RAISE

    preset = fields.String(validate=validate.OneOf(sorted(PRESETS)))
    command = fields.String(validate=validate.Length(min=1, max=20_000))
    prompt = fields.String(validate=validate.OneOf(["argument", "file", "stdin"]))
    time_limit_s = fields.Float(load_default=1800.0, validate=validate.Range(min=1,
                                                                             max=86_400))
    # More environment variables for the harness: [{"name": ..., "value": ...}] (the
    # gateway's own variables are set over them).
    env = fields.List(fields.Nested(EnvVar), load_default=list,
                      validate=validate.Length(max=100))

    @staticmethod
    def json_schema() -> dict:
        """The published JSON Schema of ``agent`` (marshmallow's would say neither "one
        of" nor what an environment variable's name may be)."""
        return {
            "type": "object", "nullable": True, "additionalProperties": False,
            "description": "an agent harness instead of the built-in loop (docs/harnesses.md)",
            "properties": {
                "preset": {"type": "string", "enum": sorted(PRESETS)},
                "command": {"type": "string", "minLength": 1, "maxLength": 20_000},
                "prompt": {"type": "string", "enum": ["argument", "file", "stdin"]},
                "time_limit_s": {"type": "number", "minimum": 1, "maximum": 86_400,
                                 "default": 1800},
                "env": {"type": "array", "maxItems": 100, "items": {
                    "type": "object", "additionalProperties": False,
                    "required": ["name", "value"], "properties": {
                        "name": {"type": "string", "pattern": _ENV_NAME.regex.pattern},
                        "value": {"type": "string", "maxLength": 100_000}}}}},
            "oneOf": [{"required": ["preset"], "not": {"required": ["command"]}},
                      {"required": ["command"], "not": {"required": ["preset"]}}]}

    @validates_schema
    def _one(self, data, **_):
        if ("preset" in data) == ("command" in data):
            raise ValidationError("name a 'preset' or give a 'command' (one of them)",
                                  "preset")


# -- installing presets -----------------------------------------------------------------


SYSTEM_PYTHON = "/usr/bin/python3"


def install(name: str, into: str, python: str = "") -> Path:
    """Build preset ``name``'s environment under ``into``, idempotent; returns its
    directory. It is a venv of the system's Python (``/usr/bin/python3``, which a sandbox
    sees as /usr is bound in), not of the farm's own interpreter, which may live anywhere.
    Its packages are pinned by ``locks/harness-NAME.txt`` where the checkout has one (``make
    lock`` writes it); built by uv where there is one (the checkout's ``.uv/bin/uv``, as
    `make` installs it, or uv on the PATH), else by venv and pip."""
    preset = PRESETS[name]
    env = Path(into) / preset.env
    stamp = env / ".installed"
    base = python or (SYSTEM_PYTHON if os.path.exists(SYSTEM_PYTHON) else sys.executable)
    lock = ROOT / "locks" / f"harness-{name}.txt"
    pins = lock.read_text() if lock.exists() else ""
    want = "\n".join((base, *preset.packages, *sorted(preset.files), pins))
    if not (stamp.exists() and stamp.read_text() == want):
        if env.exists():
            shutil.rmtree(env)
        constraints = ["-c", str(lock)] if pins else []
        uv = uv_binary()
        if uv:  # copies, not links into uv's cache (which a sandbox's uid may not read);
            # compiled, as pip does: read-only in a sandbox, it could not be compiled there
            subprocess.run([uv, "venv", "--quiet", "--python", base, str(env)], check=True)
            subprocess.run([uv, "pip", "install", "--quiet", "--link-mode", "copy",
                            "--compile-bytecode",
                            "--python", str(env / "bin" / "python"), *constraints,
                            *preset.packages], check=True)
        else:
            subprocess.run([base, "-m", "venv", str(env)], check=True)
            subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q",
                            "--disable-pip-version-check", *constraints, *preset.packages],
                           check=True)
        for inside, source in preset.files.items():
            (env / inside).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / source, env / inside)
        stamp.write_text(want)
    subprocess.run(["chmod", "-R", "a+rX", str(Path(into))], check=True)
    return env


def uv_binary() -> str | None:
    """The checkout's uv (``make`` puts it in ``.uv/``), else one on the PATH."""
    for candidate in (str(ROOT / ".uv" / "bin" / "uv"), shutil.which("uv") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


# -- running one ------------------------------------------------------------------------


def _tail(text: str) -> str:
    return text if len(text) <= TAIL_CHARS else text[-TAIL_CHARS:]


def command_line(options: dict, prompt: str, model: str) -> tuple[list[str], str | None,
                                                                    str | None]:
    """(argv, stdin, prompt file text) for a harness with these options."""
    preset = PRESETS.get(options.get("preset") or "")
    mode = options.get("prompt") or (preset.prompt if preset else "stdin")
    if preset is not None:
        values = {"env": f"{INSIDE_HARNESSES}/{preset.env}", "model": model,
                  "prompt": prompt, "prompt_file": PROMPT_FILE}
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
    env = {"HOME": "/tmp", "TERM": "dumb", **(preset.variables if preset else {}),
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
    inst, s = ctx.instance, ctx.settings
    sandbox = ctx.state.get("sandbox")
    if not sandbox:
        raise HarnessFailed("the job has no sandbox to run its harness in")
    limits = AgentLimits.from_job(inst, ctx.sampling)
    session = BackendSession(ctx.backends, ctx, max_failovers=s.llm_max_failovers,
                             request_timeout_s=s.llm_request_timeout_s, retries=s.llm_retries)
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
        first = session.backend()
        capture = Capture(load_chat_tokens(first.tokenizer), get_parser(inst["parser"]),
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
            out = _execute(ctx, options, sandbox, key, first.model, prompt)
        finally:
            server.close_job(key)
            server.stop()
            if out is None:  # cancelled, or the sandbox failed: nothing may run on
                stopper("aborted")
        job.on_end = None  # it is over: a straggling call is refused, nothing more to stop
        job.end(stopper.reason or "exited")
        return _result(ctx, options, job, stopper, out, time.monotonic() - t0)


def _execute(ctx: JobContext, options: dict, sandbox: dict, key: str, model: str,
             prompt: str) -> dict:
    argv, stdin, prompt_file = command_line(options, prompt, model)
    conn = ToolConnection(sandbox["socket"])
    try:
        if prompt_file is not None:
            wrote = conn.call("exec", abort_hook=ctx.on_abort, timeout_s=30,
                              argv=["sh", "-c", f"cat > {PROMPT_FILE}"], stdin=prompt_file)
            if wrote["exit_code"] != 0:
                raise HarnessFailed(f"could not write the prompt file: {wrote['stderr']}")
        limit = min(options.get("time_limit_s", 1800.0), max(0.1, ctx.remaining_s))
        out = conn.call("exec", abort_hook=ctx.on_abort, timeout_s=limit, argv=argv,
                        stdin=stdin, env=harness_env(options, sandbox, key, model),
                        name=EXEC_NAME)
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
    answered = (out["exit_code"] == 0 and not stopper.reason and replied.get("role") ==
                "assistant" and not job.capture.parser.parse(replied.get("content", "")).any)
    end_reason = stopper.reason or ("answered" if answered else "exited")
    if out["timed_out"]:
        end_reason = "timeout"
    result = {**last, "capture": captured["capture"],
              "stats": {"end_reason": end_reason, "turns": job.sampled,
                        "generated_tokens": job.generated, "harness_s": round(duration_s, 3)},
              "harness": {"preset": options.get("preset"), "exit_code": out["exit_code"],
                          "signal": out["signal"], "timed_out": out["timed_out"],
                          "stdout_tail": _tail(out["stdout"]),
                          "stderr_tail": _tail(out["stderr"])}}
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
