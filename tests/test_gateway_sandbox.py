"""The model gateway from inside a bwrap sandbox, which has no network: the ``openai`` SDK,
run in the sandbox with nothing but the variables the sandbox was given
(OPENAI_BASE_URL on its own loopback, OPENAI_API_KEY the job's key), reaches the job's
gateway through the tool server's relay and the Unix socket bound in, and only it: a
tool-call conversation is captured as one segment; another key, or the job's key once the
job ended, gets 401."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from prorl_farm.agent.parsers import get_parser
from prorl_farm.agent.trajectory import load_chat_tokens
from prorl_farm.gateway.capture import Capture
from prorl_farm.gateway.server import JobGateway, Sampled, UnixGatewayServer, new_key
from prorl_farm.llm.backends.abstract import _IDLE
from prorl_farm.llm.backends.vllm import VLLMClient
from prorl_farm.sandbox.abstract import GATEWAY_SOCKET, SandboxSpec, gateway_dir
from prorl_farm.sandbox.connection import ToolConnection
from prorl_farm.sandbox.manager import SandboxManager
from tests.farm import sampled_ids
from tests.policy_server import PolicyServer, text_planner

pytestmark = pytest.mark.skipif(not shutil.which("bwrap"), reason="needs bubblewrap")
CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
HARNESS = """
import json, os, openai
tools = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
sdk = openai.OpenAI(max_retries=0)
msgs = [{"role": "user", "content": "[case:ls] look around"}]
first = sdk.chat.completions.create(model="tiny", messages=msgs, tools=tools)
call = first.choices[0].message.tool_calls[0]
msgs += [first.choices[0].message.model_dump(exclude_none=True),
         {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}]
text = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(
    model="tiny", messages=msgs, tools=tools, stream=True) if c.choices)
try:
    openai.OpenAI(api_key="prorl-someone-else", max_retries=0).models.list()
    other = "served"
except openai.AuthenticationError:
    other = "refused"
print(json.dumps({"call": call.function.name, "text": text, "other": other,
                  "base": os.environ["OPENAI_BASE_URL"]}))
"""


def test_an_sdk_inside_a_bwrap_sandbox_reaches_its_jobs_gateway_only(r, tiny_model):
    policy = PolicyServer(planner=text_planner(str(tiny_model), {"ls": [CALL, "Done."]}))
    client = VLLMClient(policy.url, "tiny")
    manager = SandboxManager(r, "gw-node", "bwrap", root=f"/tmp/prs-gw-{os.getpid()}")
    key = new_key()
    sb = manager.start(SandboxSpec(gateway=True, env={"OPENAI_API_KEY": key}))
    server = UnixGatewayServer(str(gateway_dir(sb.workspace) / GATEWAY_SOCKET))
    tools = ToolConnection(sb.socket)
    returned = []

    def sampler(prompt, sampling):
        returned.append(client.generate(prompt, sampling))
        return Sampled(returned[-1], "b0", 1, "raw_logprobs")

    job = JobGateway("j", Capture(load_chat_tokens(str(tiny_model)), get_parser("hermes")),
                     sampler, {"temperature": 1.0}, "tiny", max_tokens=64)
    try:
        server.open_job(job, key)
        out = tools.ipython(HARNESS, timeout_s=60)
        assert not out.get("error"), out
        seen = json.loads(out["stdout"].strip().splitlines()[-1])
        assert seen == {"call": "bash", "text": "Done.", "other": "refused",
                        "base": f"http://{sb.ip}:8009/v1"}
        result = server.close_job(key).result()
        assert result["capture"]["calls"] == 2 and result["capture"]["merged"] == 1
        (seg,) = result["segments"]
        assert sampled_ids(seg) == [t for g in returned for t in g.token_ids]
        # The job ended: its key no longer opens the gateway.
        after = tools.ipython("import openai\ntry:\n    openai.OpenAI(max_retries=0)."
                              "models.list()\n    print('served')\nexcept openai."
                              "AuthenticationError:\n    print('refused')", timeout_s=60)
        assert after["stdout"].strip() == "refused", after
    finally:
        tools.close()
        server.stop()
        manager.stop(sb)
        shutil.rmtree(manager.root, ignore_errors=True)
        client.close()
        _IDLE.close_all()
        policy.kill()
    assert not Path(sb.workspace).exists()


def test_the_gateway_socket_is_opened_to_all_without_following_a_link_put_in_its_place(
        tmp_path):
    """The gateway directory is writable from the sandbox. An agent that puts a link where
    the socket was bound, between the bind and the socket's chmod to 0666, must not get the
    link's target (a host file, the pool's own) opened to every user: the socket is bound
    and opened where only the pool writes, then renamed into place over whatever is
    there."""
    gw = tmp_path / "gw"
    gw.mkdir()
    os.chmod(gw, 0o777)
    target = tmp_path / "pools-own-file"
    target.write_text("not the sandbox's\n")
    os.chmod(target, 0o600)
    final = gw / GATEWAY_SOCKET

    class Raced(UnixGatewayServer):
        def server_bind(self):
            super().server_bind()
            # The agent, in the window after the bind: a link to the host's file where the
            # socket is to be.
            if os.path.lexists(final):
                os.unlink(final)
            os.symlink(target, final)

    server = Raced(str(final))
    try:
        assert (target.stat().st_mode & 0o777) == 0o600
        assert final.is_socket() and not final.is_symlink()
        assert (final.stat().st_mode & 0o777) == 0o666
        assert sorted(p.name for p in tmp_path.iterdir()) == ["gw", "pools-own-file"]
    finally:
        server.stop()
    assert not final.exists()
