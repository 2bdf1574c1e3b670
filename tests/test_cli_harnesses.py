"""The coding CLIs people run, unchanged, as the agent of a job: Claude Code and Codex (the
npm registry's builds, pinned) in bwrap sandboxes through the job's gateway, on a scripted
policy. A ``math`` job each answers right earns 1 and a wrong one 0 (the answer taken from
Claude Code's JSON result, from Codex's last-message file), a ``swe`` job each fixes is
resolved (Codex's fix an ``apply_patch`` custom tool call, its output sent back); every
call is captured token-exact (one segment, the sampled ids the policy's turns). With
connections audited (strace), the only connection either makes is to the sandbox's gateway
door. A harness that ends by calling its own ``final_answer`` tool (as smolagents does) is
graded on that answer: 1 right, 0 wrong, and a harness that finishes with no answer gets 0
with the reason. A preset's job is refused a context smaller than the preset needs. Claude
Code on real vLLM (the tiny model served at 64k: its first prompt is ~20k of the tiny
tokenizer's tokens): it finishes with no error, every call captured, the first turn's ids
and logprobs what the engine gives again for the same request.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest

from prorl_farm.config import load_settings
from prorl_farm.harness import PRESETS, install
from prorl_farm.sandbox.abstract import INSIDE_HARNESSES
from tests.farm import farm_env, run_batch, sampled_ids, scripted_farm, use_only_backend
from tests.policy_server import tool_call
from tests.test_harness import _ids
from tests.test_swe import build_repos

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not shutil.which("bwrap") or not shutil.which("git"), reason="needs bubblewrap and git")]
FIX = "sed -i 's/result += b/result += a/' calc/__init__.py"
PATCH = ("*** Begin Patch\n*** Update File: calc/__init__.py\n@@\n-        result += b\n"
         "+        result += a\n*** End Patch")
PLANS = {
    "cc-add": [tool_call("Bash", command="echo $((2 + 2))", description="add"),
               "It is \\boxed{4}."],
    "cc-wrong": ["It is \\boxed{5}."],
    "cc-fix": [tool_call("Bash", command=FIX, description="fix the sum"), "Fixed."],
    "final-right": [tool_call("final_answer", answer="\\boxed{4}")],
    "final-wrong": [tool_call("final_answer", answer="5")],
    "silent": [tool_call("bash", command="true")],
    "cx-add": [tool_call("exec_command", cmd="echo $((2 + 2))"), "It is \\boxed{4}."],
    "cx-wrong": ["It is \\boxed{5}."],
    "cx-fix": [tool_call("apply_patch", input=PATCH), "Fixed."],
}
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
    for name in ("claude-code", "codex", "openai-agent"):
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
            for b in client.get("/v1/backends").get_json()["backends"]:  # none left behind
                client.delete(f"/v1/backends/{b['id']}")
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


@pytest.mark.parametrize("cli,rule,prefix", [("claude-code", "harness_json", "cc"),
                                             ("codex", "output_file", "cx")])
def test_a_cli_answers_math_and_connects_to_nothing_but_the_gateway(cli_farm, tiny_model,
                                                                    cli, rule, prefix):
    client, _, _ = cli_farm
    audited = {"preset": cli, "audit_connections": True}
    right, wrong = _math(client, [(f"{prefix}-add", audited), (f"{prefix}-wrong", audited)])
    for job in (right, wrong):
        assert job["state"] == "done", (job["failure"], job.get("result", {}).get("harness"))
        assert job["result"]["harness"]["exit_code"] == 0, job["result"]["harness"]
    assert right["reward"] == 1.0, right["result"]["eval"]
    assert wrong["reward"] == 0.0, wrong["result"]["eval"]
    result = right["result"]
    assert result["answer"]["rule"] == rule and \
        result["answer"]["text"].strip() == "It is \\boxed{4}.", result["answer"]
    assert result["stats"]["end_reason"] == "answered" and result["stats"]["turns"] == 2
    _one_exact_segment(right, tiny_model, PLANS[f"{prefix}-add"])
    # The task reached it without the built-in loop's tool instructions.
    assert "[case:" in str(result["messages"]) and "python tool" not in str(
        result["messages"])
    # Every connection attempt, of the CLI and of all it ran: the gateway's door only.
    for job in (right, wrong):
        seen = job["result"]["harness"]["connections"]
        assert seen["audited"] and seen["gateway"] >= 1 and seen["outside"] == [], seen


@pytest.mark.parametrize("cli,prefix", [("claude-code", "cc"), ("codex", "cx")])
def test_a_cli_resolves_the_sample_swe_instance(cli_farm, tiny_model, cli, prefix):
    client, _, instances = cli_farm
    case = {**instances[0], "agent": {"preset": cli}, "test_timeout_s": 60,
            "problem_statement": f"[case:{prefix}-fix] {instances[0]['problem_statement']}"}
    (job,) = run_batch(client, {"handler": "swe", "instances": [case],
                                "sampling": {"max_tokens": 512}, "deadline_s": 300}, 360)
    assert job["state"] == "done", (job["failure"], job.get("result", {}).get("harness"))
    assert job["reward"] == 1.0 and job["result"]["eval"]["resolved"], job["result"]["eval"]
    assert "+        result += a\n" in job["result"]["eval"]["diff"]
    assert job["result"]["answer"]["text"].strip() == "Fixed."
    _one_exact_segment(job, tiny_model, PLANS[f"{prefix}-fix"])
    if cli == "codex":  # apply_patch's call went out as a custom tool call, and came back
        replies = [m for m in job["result"]["messages"] if m["role"] == "assistant"]
        assert '"name": "apply_patch"' in replies[0]["content"]


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
    assert resp.get_json()["error"]["code"] == "insufficient_context"
    details = resp.get_json()["error"]["details"]["instances"]["0"]
    assert f"needs a context of {need} tokens" in details["sampling.context_length"][0]


def test_claude_code_on_real_vllm_at_64k_context(cli_farm, vllm_server, vllm_model,
                                                 tiny_model):
    import requests

    from prorl_farm.llm.backends.abstract import SAMPLING_DEFAULTS
    from tests.conftest import VLLM_CONTEXT

    client, server, _ = cli_farm
    use_only_backend(client, url=vllm_server, kind="vllm", model="tiny",
                     tokenizer=str(vllm_model), capacity=4)
    try:
        # A random model rarely ends its turn: these stop ids end each reply in a few
        # tokens, as a model's end of turn would (a reply cut at max_tokens Claude Code
        # treats as an error). No seed: vLLM's CPU build fails a seeded request whose
        # prompt is prefilled in chunks ("CPU Generator does not use offset").
        sampling = {"max_tokens": 32, "temperature": 1.0, "max_turns": 4,
                    "stop_token_ids": list(range(300, 700))}
        (job,) = run_batch(client, {"handler": "math", "sampling": sampling,
                                    "deadline_s": 400, "instances": [{
                                        "problem": "What is 2 + 2?", "answer": "4",
                                        "agent": {"preset": "claude-code"}}]}, 460)
    finally:
        use_only_backend(client, url=server.url, kind="vllm", model="tiny",
                         tokenizer=str(tiny_model), capacity=64)
    assert job["state"] == "done", (job["failure"], (job.get("result") or {}).get("harness"))
    result = job["result"]
    assert result["harness"]["exit_code"] == 0
    assert result["answer"]["rule"] == "harness_json", result["answer"]
    assert len(result["prompt_ids"]) > 10_000 and result["capture"]["segments"] == 1
    assert len(result["prompt_ids"]) + len(result["response_ids"]) < VLLM_CONTEXT
    # The engine itself, teacher-forced on the first turn: the logprobs of the sampled ids.
    k = result["turns"][0]["generated"]
    forced = requests.post(vllm_server + "/v1/completions", json={
        "model": "tiny", "prompt": result["prompt_ids"] + result["response_ids"][:k],
        "max_tokens": 1, "prompt_logprobs": 0, "return_token_ids": True,
        **{f: v for f, v in SAMPLING_DEFAULTS.items() if f != "ignore_eos"}},
        timeout=120).json()["choices"][0]["prompt_logprobs"][-k:]
    got = [next(iter(d.values()))["logprob"] if len(d) == 1 else
           d[str(t)]["logprob"] for d, t in zip(forced, result["response_ids"][:k])]
    assert max(abs(a - b) for a, b in zip(got, result["response_logprobs"][:k])) < 1e-4
