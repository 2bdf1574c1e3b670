"""The coding CLIs people run, unchanged, as the agent of a job: Claude Code (the npm
registry's build, pinned) in a bwrap sandbox through the job's gateway, on a scripted
policy. A ``math`` job it answers right earns 1 and a wrong one 0 (its answer taken from
its own JSON result), a ``swe`` job it fixes is resolved; every call is captured token-exact
(one segment, the sampled ids as the policy returned them). Under ``strace``, the only
connection it makes is to the sandbox's gateway door. A harness that ends by calling its
own ``final_answer`` tool (as smolagents does) is graded on that answer: 1 right, 0 wrong,
and a harness that finishes with no answer gets 0 with the reason.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest

from prorl_farm.config import load_settings
from prorl_farm.gateway.harness import PRESETS, install
from prorl_farm.sandbox.abstract import INSIDE_HARNESSES
from tests.farm import farm_env, run_batch, sampled_ids, scripted_farm, use_only_backend
from tests.policy_server import tool_call
from tests.test_harness import _ids
from tests.test_swe import build_repos

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not shutil.which("bwrap") or not shutil.which("git"), reason="needs bubblewrap and git")]
FIX = "sed -i 's/result += b/result += a/' calc/__init__.py"
PLANS = {
    "cc-add": [tool_call("Bash", command="echo $((2 + 2))", description="add"),
               "It is \\boxed{4}."],
    "cc-wrong": ["It is \\boxed{5}."],
    "cc-fix": [tool_call("Bash", command=FIX, description="fix the sum"), "Fixed."],
    "final-right": [tool_call("final_answer", answer="\\boxed{4}")],
    "final-wrong": [tool_call("final_answer", answer="5")],
    "silent": [tool_call("bash", command="true")],
}
CLAUDE = f"{INSIDE_HARNESSES}/claude-code/bin/claude"
# Claude Code as its preset runs it, under strace: every connect() it (and whatever it
# starts) makes goes to stderr after it, its JSON result stays the last line of stdout.
TRACED_CLAUDE = (
    "export ANTHROPIC_AUTH_TOKEN=$ANTHROPIC_API_KEY ANTHROPIC_MODEL=$PRORL_MODEL "
    "ANTHROPIC_DEFAULT_HAIKU_MODEL=$PRORL_MODEL CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 "
    "DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1 IS_SANDBOX=1\n"
    "strace -f -qq -e trace=connect -o /tmp/connects.txt "
    f"{CLAUDE} -p \"$1\" --output-format json --dangerously-skip-permissions --max-turns 5\n"
    "status=$?\nsed 's/^/TRACE /' /tmp/connects.txt >&2\nexit $status")
# A smolagents-style harness: it asks once, and the model's final_answer call is its end.
FINAL_ANSWER = f"""{INSIDE_HARNESSES}/openai-agent/bin/python - "$1" <<'EOF'
import openai, sys
tools = [{{"type": "function", "function": {{"name": "final_answer", "parameters": {{
    "type": "object", "properties": {{"answer": {{"type": "string"}}}}}}}}}}]
sdk = openai.OpenAI(max_retries=0)
reply = sdk.chat.completions.create(model="m", tools=tools, messages=[
    {{"role": "user", "content": sys.argv[1]}}])
print("final answer called:", bool(reply.choices[0].message.tool_calls))
EOF"""


@pytest.fixture(scope="module")
def cli_farm(redis_server, tmp_path_factory, tiny_model):
    path = load_settings(farm_env("redis://unused")).harness_path
    for name in ("claude-code", "openai-agent"):
        install(name, path)
    repos = Path(tempfile.mkdtemp(prefix="prs-cli-repos-"))
    repos.chmod(0o755)
    instances = build_repos(repos)
    try:
        with scripted_farm(redis_server.url, tmp_path_factory.mktemp("cli"), str(tiny_model),
                           PLANS, "cli", sandbox_mount_roots=str(repos),
                           harness_dir=path) as (client, server):
            use_only_backend(client, url=server.url, kind="vllm", model="tiny",
                             tokenizer=str(tiny_model), capacity=64)
            yield client, server, instances
    finally:
        shutil.rmtree(repos, ignore_errors=True)


def _math(client, cases: list[tuple[str, dict]]) -> list[dict]:
    instances = [{"problem": f"[case:{case}] What is 2 + 2?", "answer": "4", "agent": agent}
                 for case, agent in cases]
    return run_batch(client, {"handler": "math", "instances": instances,
                              "sampling": {"max_tokens": 256}, "deadline_s": 240}, 300)


def _one_exact_segment(job: dict, tiny_model, plan: list[str]) -> None:
    """One segment holding every call, its sampled ids the policy's turns exactly."""
    result = job["result"]
    capture = result["capture"]
    assert capture["segments"] == 1 and capture["merged"] == capture["calls"] - 1, capture
    assert "segments" not in result
    assert sampled_ids(result) == _ids(tiny_model, *plan)


def test_claude_code_answers_math_and_makes_no_connection_but_the_gateway(cli_farm,
                                                                            tiny_model):
    client, _, _ = cli_farm
    traced = {"command": TRACED_CLAUDE, "prompt": "argument", "answer": "harness_json"}
    right, wrong, preset = _math(client, [("cc-add", traced), ("cc-wrong", traced),
                                          ("cc-add", {"preset": "claude-code"})])
    for job in (right, wrong, preset):
        assert job["state"] == "done", (job["failure"], job.get("result", {}).get("harness"))
    assert right["reward"] == 1.0 and preset["reward"] == 1.0, right["result"]["eval"]
    assert wrong["reward"] == 0.0, wrong["result"]["eval"]
    for job in (right, preset):
        result = job["result"]
        assert result["answer"] == {"rule": "harness_json", "text": "It is \\boxed{4}."}
        assert result["stats"]["end_reason"] == "answered" and result["stats"]["turns"] == 2
        assert result["harness"]["exit_code"] == 0
        _one_exact_segment(job, tiny_model, PLANS["cc-add"])
        # The task reached it without the built-in loop's tool instructions.
        assert "python tool" not in job["result"]["messages"][1]["content"]
    # Every connection attempt, of Claude Code and of what it ran: the gateway's door only.
    for job in (right, wrong):
        trace = [line for line in job["result"]["harness"]["stderr_tail"].splitlines()
                 if line.startswith("TRACE ") and "connect(" in line]
        inet = [line for line in trace if "AF_INET" in line]
        assert inet and all("htons(8009)" in line for line in inet), trace
        assert not [line for line in trace if "AF_INET" not in line
                    and "AF_UNIX" not in line], trace


def test_claude_code_resolves_the_sample_swe_instance(cli_farm, tiny_model):
    client, _, instances = cli_farm
    case = {**instances[0], "agent": {"preset": "claude-code"}, "test_timeout_s": 60,
            "problem_statement": f"[case:cc-fix] {instances[0]['problem_statement']}"}
    (job,) = run_batch(client, {"handler": "swe", "instances": [case],
                                "sampling": {"max_tokens": 512}, "deadline_s": 300}, 360)
    assert job["state"] == "done", (job["failure"], job.get("result", {}).get("harness"))
    assert job["reward"] == 1.0 and job["result"]["eval"]["resolved"], job["result"]["eval"]
    assert job["result"]["answer"]["text"] == "Fixed."
    _one_exact_segment(job, tiny_model, PLANS["cc-fix"])


def test_a_final_answer_tool_call_is_the_answer_and_no_answer_is_0_with_the_reason(cli_farm):
    client, _, _ = cli_farm
    own = {"command": FINAL_ANSWER, "prompt": "argument"}
    right, wrong, silent = _math(client, [("final-right", own), ("final-wrong", own),
                                          ("silent", own)])
    for job in (right, wrong, silent):
        assert job["state"] == "done", job["failure"]
    assert right["reward"] == 1.0 and wrong["reward"] == 0.0, right["result"]["eval"]
    assert right["result"]["answer"] == {"rule": "final_answer_tool", "text": "\\boxed{4}"}
    assert silent["reward"] == 0.0 and silent["result"]["answer"]["rule"] is None
    assert re.search(r"no answer \(last_text: .*final_answer_tool: ",
                     silent["result"]["eval"]["verdict"]), silent["result"]["eval"]


def test_a_harness_job_is_refused_a_context_smaller_than_its_preset_needs(cli_farm):
    client, _, _ = cli_farm
    need = PRESETS["claude-code"].context
    inst = {"problem": "x", "answer": "1", "agent": {"preset": "claude-code"}}
    resp = client.post("/v1/jobs", json={"handler": "math", "instances": [inst],
                                         "sampling": {"context_length": 32_768}})
    assert resp.status_code == 400, resp.get_json()
    details = resp.get_json()["error"]["details"]["instances"]["0"]
    assert f"needs a context of {need} tokens" in details["sampling.context_length"][0]
