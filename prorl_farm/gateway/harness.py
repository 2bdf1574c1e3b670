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

The result is the last segment of the capture as the trajectory, earlier segments in
``segments``, the capture stats, the harness's exit status and output tails, and its
``answer``: what EVAL grades for an answer task, taken by the preset's rule (:data:`ANSWER_
RULES`) and saying which rule gave it. A harness that exits non-zero, or without a sampled
call, fails the job ``harness_error`` (never a zero reward); one that finishes with no
answer earns 0, with the reason.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from marshmallow import RAISE, Schema, ValidationError, fields, validate, validates_schema

from prorl_farm.agent.loop import CONTEXT_LENGTH, AgentLimits
from prorl_farm.agent.parsers import get_parser
from prorl_farm.agent.trajectory import load_chat_tokens
from prorl_farm.context import JobContext
from prorl_farm.errors import HarnessFailed, StageTimeout
from prorl_farm.gateway.capture import Capture
from prorl_farm.gateway.server import JobGateway, Sampled, UnixGatewayServer
from prorl_farm.llm.session import BackendSession, turn_seed
from prorl_farm.sandbox.abstract import (
    GATEWAY_PORT,
    GATEWAY_SOCKET,
    INSIDE_HARNESSES,
    gateway_dir,
    gateway_env,
)
from prorl_farm.sandbox.connection import ToolConnection

PROMPT_FILE = "/tmp/prorl-prompt.txt"
# What a harness is told besides the SDKs' own variables: the model's name, the prompt file.
MODEL_ENV, PROMPT_FILE_ENV = "PRORL_MODEL", "PRORL_PROMPT_FILE"
TAIL_CHARS = 64 * 1024  # of the harness's stdout and stderr, kept with the job
EXEC_NAME = "harness"
ROOT = Path(__file__).resolve().parents[2]
NPM_REGISTRY = "https://registry.npmjs.org"
# How a harness's answer is taken for an answer task (math, stem, code): the rule names.
ANSWER_RULES = {
    "last_text": "the last assistant message, if it called no tool",
    "final_answer_tool": "the argument of a final_answer-style tool call (final_answer, "
                         "submit_answer, answer) that ends the conversation",
    "harness_json": "the `result` of the JSON the harness prints last (claude -p "
                    "--output-format json), when it reports no error",
    "output_file": "the text of the file the harness writes its answer to (answer_file)",
}
FINAL_ANSWER_TOOLS = ("final_answer", "submit_answer", "answer")


@dataclass(frozen=True)
class NpmBinary:
    """A program from a package on the npm registry: pinned by version and integrity, the
    tarball kept in a download cache, one file of it put in the preset's environment."""

    package: str
    version: str
    integrity: str  # "sha512-..." as the registry publishes it
    member: str  # the file in the tarball
    dest: str  # where it goes, relative to the environment


@dataclass(frozen=True)
class Preset:
    """A harness the farm knows how to install and run."""

    env: str  # its environment under PRORL_HARNESS_DIR
    argv: tuple[str, ...]  # {env} {prompt} {prompt_file} {model} {max_turns} filled in
    prompt: str  # how the prompt is handed over: argument, file or stdin
    packages: tuple[str, ...]  # what `prorl-farm harness install` puts in the environment
    variables: dict[str, str] = field(default_factory=dict)  # {key} {model} filled in
    files: dict[str, str] = field(default_factory=dict)  # env-relative -> checkout-relative
    about: str = ""
    binaries: tuple[NpmBinary, ...] = ()
    answer: tuple[str, ...] = ("last_text", "final_answer_tool")  # rules, tried in order
    answer_file: str = ""  # the output_file rule's file
    context: int = 0  # the context (tokens) the harness needs: its prompt and some turns
    # Files written in the sandbox before it runs (its configuration), from the run's
    # values: the model's name, the gateway's base URL, the job's context.
    setup: Callable[[dict], dict[str, str]] | None = None


CODEX_HOME = "/tmp/codex"
CODEX_LAST_MESSAGE = f"{CODEX_HOME}/last-message.txt"
CODEX_CONFIG = """model = {model}
model_provider = "prorl"
model_catalog_json = "{home}/catalog.json"
model_context_window = {context}
approval_policy = "never"
sandbox_mode = "danger-full-access"
web_search = "disabled"
check_for_update_on_startup = false

[analytics]
enabled = false

[features]
plugins = false
apps = false

[agents]
enabled = false

[model_providers.prorl]
name = "prorl-farm"
base_url = {base_url}
env_key = "OPENAI_API_KEY"
wire_api = "responses"
request_max_retries = 4
stream_max_retries = 0
"""


def _codex_setup(values: dict) -> dict[str, str]:
    """Codex's configuration for a run: a provider at the job's gateway (Responses API),
    analytics, plugins, apps, sub-agents and web search off, and a model catalog entry for
    the served model's name (Codex keeps apply_patch, its custom tool, only for a model it
    knows: the entry is its own GPT-5.5 entry under that name)."""
    entry = json.loads((Path(__file__).with_name("codex_model.json")).read_text())
    entry.update(slug=values["model"], display_name=values["model"],
                 context_window=values["context"], max_context_window=values["context"])
    config = CODEX_CONFIG.format(model=json.dumps(values["model"]), home=CODEX_HOME,
                                 context=values["context"],
                                 base_url=json.dumps(values["base_url"]))
    return {f"{CODEX_HOME}/config.toml": config,
            f"{CODEX_HOME}/catalog.json": json.dumps({"models": [entry]})}


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
    "claude-code": Preset(
        "claude-code",
        ("{env}/bin/claude", "-p", "{prompt}", "--output-format", "json",
         "--dangerously-skip-permissions", "--max-turns", "{max_turns}"),
        "argument", (),
        {"ANTHROPIC_AUTH_TOKEN": "{key}", "ANTHROPIC_MODEL": "{model}",
         "ANTHROPIC_DEFAULT_HAIKU_MODEL": "{model}", "ANTHROPIC_SMALL_FAST_MODEL": "{model}",
         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
         "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "IS_SANDBOX": "1"},
        binaries=(NpmBinary(
            "@anthropic-ai/claude-code-linux-x64", "2.1.332",
            "sha512-f4JWhzwYutJIHScC7/dYOPX6s28tt7ZADhsOi8zwOHq5fFPEuUeChh2NMfinSg0GrUckYxaeeb"
            "C4h0DqiKzLcw==", "package/claude", "bin/claude"),),
        answer=("harness_json",), context=65_536,
        about="Claude Code (npm @anthropic-ai/claude-code 2.1.332, its linux-x64 binary): "
              "claude -p, JSON output, permissions skipped, through the Messages endpoint; "
              "its first prompt is about 33k tokens"),
    "codex": Preset(
        "codex",
        ("{env}/bin/codex", "exec", "--skip-git-repo-check",
         "--dangerously-bypass-approvals-and-sandbox", "--json", "-o", CODEX_LAST_MESSAGE,
         "{prompt}"),
        "argument", (), {"CODEX_HOME": CODEX_HOME},
        binaries=(NpmBinary(
            "@openai/codex", "0.171.0-linux-x64",
            "sha512-l66NZkQgdk2C3pbcfULDz42yEUB581MVA6I+Y43Wp4OIqEy73HCdmZ0GTjeAHY2ycuH4N00d9V"
            "sLrwT1jxshTw==", "package/vendor/x86_64-unknown-linux-musl/bin/codex",
            "bin/codex"),),
        answer=("output_file",), answer_file=CODEX_LAST_MESSAGE, context=32_768,
        setup=_codex_setup,
        about="Codex CLI (npm @openai/codex 0.171.0, its static linux-x64 binary): codex "
              "exec, JSON events, approvals and its own sandbox off (the farm's is the "
              "sandbox), through the Responses endpoint; its last message (-o) is the "
              "answer"),
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
    # How the answer is taken (answer tasks): the preset's rules by default.
    answer = fields.String(validate=validate.OneOf(sorted(ANSWER_RULES)))
    answer_file = fields.String(validate=[validate.Regexp(r"^/[^\x00]*\Z"),
                                          validate.Length(max=1001)])
    # Run the harness under strace and report every connect() it and its children made
    # (``harness.connections``): what it tried to reach besides the gateway.
    audit_connections = fields.Boolean(load_default=False)
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
                "answer": {"type": "string", "enum": sorted(ANSWER_RULES)},
                "answer_file": {"type": "string", "pattern": "^/[^\\u0000]*$",
                                "maxLength": 1001},
                "audit_connections": {"type": "boolean", "default": False},
                "time_limit_s": {"type": "number", "minimum": 1, "maximum": 86_400,
                                 "default": 1800},
                "env": {"type": "array", "maxItems": 100, "items": {
                    "type": "object", "additionalProperties": False,
                    "required": ["name", "value"], "properties": {
                        "name": {"type": "string", "pattern": _ENV_NAME.regex.pattern},
                        "value": {"type": "string", "maxLength": 100_000}}}}},
            "oneOf": [{"required": ["preset"], "not": {"required": ["command"]}},
                      {"required": ["command"], "not": {"required": ["preset"]}}],
            # The output_file rule needs a file: the instance's, or its preset's.
            "anyOf": [{"not": {"required": ["answer"],
                               "properties": {"answer": {"enum": ["output_file"]}}}},
                      {"required": ["answer_file"]},
                      {"required": ["preset"], "properties": {"preset": {"enum": sorted(
                          n for n, p in PRESETS.items() if p.answer_file)}}}]}

    @validates_schema
    def _one(self, data, **_):
        if ("preset" in data) == ("command" in data):
            raise ValidationError("name a 'preset' or give a 'command' (one of them)",
                                  "preset")
        if data.get("answer") == "output_file" and not (
                data.get("answer_file") or PRESETS.get(data.get("preset", "")) and
                PRESETS[data["preset"]].answer_file):
            raise ValidationError("the output_file rule needs the file: 'answer_file'",
                                  "answer_file")


def needed_context(options: dict | None) -> int:
    """The context (tokens) a harness needs: its preset's (0: none stated)."""
    preset = PRESETS.get((options or {}).get("preset") or "")
    return preset.context if preset else 0


def context_refusal(instance: dict, sampling: dict, served: list[int | None]
                    ) -> dict[str, list[str]]:
    """Why a harness job cannot have the context its preset needs, by field ({}: it can):
    the job's own ``context_length`` (the instance's over the request's) is smaller, or
    every backend registered serves a smaller one (``max_model_len``; none registered, or
    one whose length is unknown: not refused)."""
    options = instance.get("agent") or {}
    need = needed_context(options)
    if not need:
        return {}
    name = options["preset"]
    for where, source in (("context_length", instance), ("sampling.context_length",
                                                         sampling)):
        asked = source.get("context_length")
        if asked is not None:
            if asked < need:
                return {where: [f"the {name} harness needs a context of {need} tokens (its "
                                f"first prompt alone is long); this job asks for {asked}"]}
            break
    if served and all(length and length < need for length in served):
        return {"agent": {"preset": [
            f"the {name} harness needs a context of {need} tokens; the backends registered "
            f"serve at most {max(served)} (their max_model_len): serve the model with a "
            "longer context"]}}
    return {}


# -- installing presets -----------------------------------------------------------------


SYSTEM_PYTHON = "/usr/bin/python3"


def install(name: str, into: str, python: str = "", cache: str = "") -> Path:
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
    want = "\n".join((base, *preset.packages, *sorted(preset.files), pins,
                      *(f"{b.package}@{b.version} {b.integrity}" for b in preset.binaries)))
    if not (stamp.exists() and stamp.read_text() == want):
        if env.exists():
            shutil.rmtree(env)
        constraints = ["-c", str(lock)] if pins else []
        uv = uv_binary()
        if not preset.packages:  # a program of its own: no Python environment
            env.mkdir(parents=True)
        elif uv:  # copies, not links into uv's cache (which a sandbox's uid may not read);
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
        for binary in preset.binaries:
            _npm_binary(binary, env, npm_cache(cache))
        for inside, source in preset.files.items():
            (env / inside).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / source, env / inside)
        stamp.write_text(want)
    subprocess.run(["chmod", "-R", "a+rX", str(Path(into))], check=True)
    return env


def npm_cache(configured: str = "") -> Path:
    """Where downloaded npm tarballs are kept: the setting (``PRORL_NPM_CACHE``), else the
    user's cache directory."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prorl-farm"
    return Path(configured) if configured else default / "npm"


def _npm_binary(binary: NpmBinary, env: Path, cache: Path) -> None:
    """Put ``binary`` in ``env``: its tarball from the cache, or downloaded from the registry
    into it; either way checked against the pinned integrity first."""
    algo, _, digest = binary.integrity.partition("-")
    name = binary.package.rsplit("/", 1)[-1]
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"{binary.package.replace('/', '+')}-{binary.version}.tgz"

    def intact() -> bool:
        h = hashlib.new(algo)
        with open(tarball, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return base64.b64encode(h.digest()).decode() == digest

    if not (tarball.exists() and intact()):
        url = f"{NPM_REGISTRY}/{binary.package}/-/{name}-{binary.version}.tgz"  # as npm's
        part = tarball.with_suffix(f".part{os.getpid()}")
        with urllib.request.urlopen(url, timeout=600) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        os.replace(part, tarball)
        if not intact():
            tarball.unlink()
            raise RuntimeError(f"{binary.package}@{binary.version}: the download does not "
                               f"match its pinned integrity {binary.integrity}")
    dest = env / binary.dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        src = tar.extractfile(binary.member)
        if src is None:
            raise RuntimeError(f"{binary.package}@{binary.version} has no {binary.member}")
        with src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    dest.chmod(0o755)


def uv_binary() -> str | None:
    """The checkout's uv (``make`` puts it in ``.uv/``), else one on the PATH."""
    for candidate in (str(ROOT / ".uv" / "bin" / "uv"), shutil.which("uv") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


# -- running one ------------------------------------------------------------------------


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
    inst, s = ctx.instance, ctx.settings
    sandbox = ctx.state.get("sandbox")
    if not sandbox:
        raise HarnessFailed("the job has no sandbox to run its harness in")
    limits = AgentLimits.from_job(inst, ctx.sampling, context_length=max(
        CONTEXT_LENGTH, needed_context(options)))
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
