"""The harness presets the farm knows (mini-SWE-agent, an openai-SDK loop, Claude Code,
Codex), an instance's ``agent`` options, and the context a preset needs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from marshmallow import RAISE, Schema, ValidationError, fields, validate, validates_schema

PROMPT_FILE = "/tmp/prorl-prompt.txt"
# What a harness is told besides the SDKs' own variables: the model's name, the prompt file.
MODEL_ENV, PROMPT_FILE_ENV = "PRORL_MODEL", "PRORL_PROMPT_FILE"
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


