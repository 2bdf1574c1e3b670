"""``shell``: files in a fresh sandbox, commands in its bash, a check command for the reward.

INIT starts the sandbox with the instance's files and runs its ``setup`` commands; RUN runs
``commands`` one by one in the same shell (RUN sees every field but ``check``); EVAL takes
the files the commands left in the workspace into a *fresh* sandbox and runs ``check`` there
with ``bash --noprofile --norc -c`` in a clean environment: exit status 0 is reward 1.0.
Nothing the commands did to their shell or processes can touch the check.
A scripted stand-in for an agent (the same sandbox and tools an agent loop uses), for
environment checks, tests and benchmarks, and the scripted adversary of the confinement
tests.
"""

from __future__ import annotations

from marshmallow import RAISE, Schema, fields, validate

from prorl_farm.handlers.base import AgentHandler, JobContext, run_setup, sandbox_bash
from prorl_farm.sandbox.abstract import SandboxSpec
from prorl_farm.sandbox.connection import ToolConnection
from prorl_farm.sandbox.isolated import agent_files, run_isolated


class ShellInstance(Schema):
    class Meta:
        unknown = RAISE

    files = fields.Dict(keys=fields.String(), values=fields.String(), load_default=dict)
    setup = fields.List(fields.String(), load_default=list)
    commands = fields.List(fields.String(), load_default=list)
    check = fields.String(load_default="true")
    command_timeout_s = fields.Float(load_default=60.0, validate=validate.Range(min=0.1,
                                                                                max=86400))
    network = fields.Boolean(load_default=False)


class ShellHandler(AgentHandler):
    name = "shell"
    description = "Run commands in a sandbox; reward 1 if the check command exits 0."
    instance_schema = ShellInstance
    visible_fields = ("files", "setup", "commands", "command_timeout_s", "network")
    warmable = True

    def allowed_by(self, settings) -> dict:
        return {} if settings.sandbox_network else {"network": {"enum": [False]}}

    def refusals(self, instance: dict, settings) -> dict:
        if instance["network"] and not settings.sandbox_network:
            return {"network": ["this farm does not give sandboxes the outside network "
                                "(an operator enables it with PRORL_SANDBOX_NETWORK=1)"]}
        return {}

    def _client(self, ctx: JobContext) -> ToolConnection:
        return ToolConnection(ctx.state["sandbox"]["socket"])

    def init(self, ctx: JobContext) -> dict:
        spec = SandboxSpec(workspace_files=ctx.instance["files"], network=ctx.instance["network"])
        sandbox = ctx.sandboxes.start(spec, ctx.job_id, ctx.requeues, ctx)
        ctx.state = {"sandbox": sandbox.to_dict()}
        client = self._client(ctx)
        try:
            run_setup(ctx, client, ctx.instance["setup"], ctx.instance["command_timeout_s"])
        finally:
            client.close()
        return ctx.state

    def run(self, ctx: JobContext) -> dict:
        client = self._client(ctx)
        steps = []
        try:
            for command in ctx.instance["commands"]:
                out = sandbox_bash(ctx, client, command, ctx.instance["command_timeout_s"])
                steps.append({"command": command, **out})
        finally:
            client.close()
        return {"steps": steps}

    def eval(self, ctx: JobContext) -> dict:
        files = agent_files(ctx)
        out = run_isolated(ctx, files, ["bash", "--noprofile", "--norc", "-c",
                                        ctx.instance["check"]],
                           timeout_s=ctx.instance["command_timeout_s"])
        passed = out["exit_code"] == 0 and not out["timed_out"]
        return {"reward": 1.0 if passed else 0.0, "check_exit_code": out["exit_code"],
                "check_output": (out["stdout"] + out["stderr"])[-4000:]}
