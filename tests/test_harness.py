"""Agent harnesses as the agent of a job, through real pools and bwrap (then docker)
sandboxes: the ``openai-agent`` preset (examples/harnesses/openai_agent.py on the real
``openai`` SDK) and mini-SWE-agent (the PyPI package, unchanged) play a scripted policy's
turns through the job's gateway; EVAL grades what they leave as for the built-in loop (math
1 or 0, the sample ``swe`` instance resolved 1 or left 0). A harness that rewrites its
history starts a new segment; a job's key is refused by another job and after its job
ended; a harness that hangs fails ``timeout`` with nothing left running; one that exits
non-zero or never calls the model fails ``harness_error``; a limit ends the episode and
EVAL still grades it; the tiny model behind the farm: sampled ids as returned, teacher-
forced logprobs within 1e-3. Red team: a harness that crawls its sandbox and the gateway for
the answer, and asks the gateway to fetch URLs, finds and fetches nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from prorl_farm.config import load_settings
from prorl_farm.harness import PRESETS, install
from prorl_farm.sandbox.abstract import INSIDE_HARNESSES
from tests.farm import (
    ROOT,
    RedisServer,
    docker_settings,
    farm_env,
    own_processes,
    part_param,
    pool_user,
    readable_copy,
    run_batch,
    sampled_ids,
    sandbox_root,
    scripted_farm,
    use_only_backend,
    wait_until,
)
from tests.policy_server import tool_call
from tests.test_swe import build_repos
from tests.test_tokens import teacher_forced_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not shutil.which("bwrap") or not shutil.which("git"), reason="needs bubblewrap and git")]
PYTHON = f"{INSIDE_HARNESSES}/openai-agent/bin/python"
FIX = "sed -i 's/result += b/result += a/' calc/__init__.py"
WRONG = "sed -i 's/result += b/result += a + 1/' calc/__init__.py"
DONE = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
PLANS = {
    "add": [tool_call("bash", command="echo $((2 + 2))"), "It is \\boxed{4}."],
    "wrong": ["It is \\boxed{5}."],
    "fix": [tool_call("bash", command=FIX), tool_call("bash", command=DONE)],
    "wrong-fix": [tool_call("bash", command=WRONG), tool_call("bash", command=DONE)],
    "talk": ["Let me think.", "Still thinking.", "\\boxed{4}"],
    "loop": [tool_call("bash", command="true")],
    "sdk": [tool_call("bash", command="ls"), tool_call("bash", command="pwd"), "All done."],
    "crawl": ["It is \\boxed{5}."],
}
# The SDKs as a harness uses them: a tool-call conversation of three turns, OpenAI streamed
# (tool-call argument deltas put back together), Anthropic whole, streamed, whole.
OPENAI_SDK = f"""{PYTHON} - <<'EOF'
import json, openai, os
tools = [{{"type": "function", "function": {{"name": "bash", "parameters": {{
    "type": "object", "properties": {{"command": {{"type": "string"}}}}}}}}}}]
sdk = openai.OpenAI(max_retries=0)
msgs = [{{"role": "user", "content": "[case:sdk] look around"}}]
seen = []
for turn in range(3):
    text, calls = "", {{}}
    for chunk in sdk.chat.completions.create(model=os.environ["PRORL_MODEL"], messages=msgs,
                                             tools=tools, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for d in delta.tool_calls or []:
            c = calls.setdefault(d.index, {{"id": d.id, "type": "function",
                                           "function": {{"name": "", "arguments": ""}}}})
            c["function"]["name"] += d.function.name or ""
            c["function"]["arguments"] += d.function.arguments or ""
    message = {{"role": "assistant", "content": text or None}}
    if calls:
        message["tool_calls"] = list(calls.values())
    msgs.append(message)
    seen.append([c["function"]["name"] + c["function"]["arguments"] for c in calls.values()]
                or text)
    for c in calls.values():
        command = json.loads(c["function"]["arguments"])["command"]
        msgs.append({{"role": "tool", "tool_call_id": c["id"], "content": "ran " + command}})
print(json.dumps(seen))
EOF"""
ANTHROPIC_SDK = f"""{PYTHON} - <<'EOF'
import anthropic, json
tools = [{{"name": "bash", "input_schema": {{"type": "object", "properties": {{
    "command": {{"type": "string"}}}}}}}}]
sdk = anthropic.Anthropic(max_retries=0)
msgs = [{{"role": "user", "content": "[case:sdk] look around"}}]
seen = []
for turn in range(3):
    kw = dict(model="m", max_tokens=200, system="You run commands.", messages=msgs,
              tools=tools)
    if turn == 1:
        with sdk.messages.stream(**kw) as stream:
            reply = stream.get_final_message()
    else:
        reply = sdk.messages.create(**kw)
    msgs.append({{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in reply.content]}})
    uses = [b for b in reply.content if b.type == "tool_use"]
    seen.append([b.name + json.dumps(b.input) for b in uses] or reply.content[0].text)
    if uses:
        msgs.append({{"role": "user", "content": [{{"type": "tool_result", "tool_use_id": b.id,
            "content": "ran " + b.input["command"]}} for b in uses]}})
print(json.dumps(seen))
EOF"""
# A harness of its own: two calls, then a third with its first message rewritten (a
# summarised history), then it answers what the model said.
REWRITER = f"""{PYTHON} - <<'EOF'
import openai, os
sdk = openai.OpenAI(max_retries=0)
msgs = [{{"role": "user", "content": open(os.environ["PRORL_PROMPT_FILE"]).read()}}]
for turn in range(2):
    reply = sdk.chat.completions.create(model=os.environ["PRORL_MODEL"], messages=msgs)
    msgs += [{{"role": "assistant", "content": reply.choices[0].message.content}},
             {{"role": "user", "content": "Go on."}}]
msgs[0]["content"] = "[case:talk] (summary) the problem asks for 2 + 2."
print(sdk.chat.completions.create(model="m", messages=msgs).choices[0].message.content)
EOF"""
# Prints its key, calls once, answers; or (with OTHER set) tries OTHER's key first.
KEYS = f"""{PYTHON} - <<'EOF'
import openai, os
print("KEY=" + os.environ["OPENAI_API_KEY"])
if os.environ.get("OTHER"):
    try:
        openai.OpenAI(api_key=os.environ["OTHER"], max_retries=0).models.list()
        print("OTHER=served")
    except openai.AuthenticationError:
        print("OTHER=refused")
msgs = [{{"role": "user", "content": "[case:add] 2 + 2?"}}]
sdk = openai.OpenAI(max_retries=0)
sdk.chat.completions.create(model="m", messages=msgs)
print(sdk.chat.completions.create(model="m", messages=msgs).choices[0].message.content)
EOF"""
LOOPER = f"""{PYTHON} - <<'EOF'
import openai
sdk = openai.OpenAI(max_retries=0)
msgs = [{{"role": "user", "content": "[case:loop] go"}}]
while True:
    msgs += [sdk.chat.completions.create(model="m", messages=msgs).choices[0].message
             .model_dump(exclude_none=True), {{"role": "user", "content": "again"}}]
EOF"""


# A policy that makes its harness look for the answer (red team): every file of the
# sandbox's writable and configuration trees, every visible process's environment and
# command line, every route of the gateway it can name (with its key, GET and POST), and a
# model call whose content asks the gateway to fetch URLs on the farm's side (an OpenAI
# image part, an Anthropic image source). It gets the answer only reversed (so its own
# command line does not hold it) and prints what it found; then it answers as the model
# says.
CRAWLER = f"""{PYTHON} - <<'EOF'
import json, os, stat, urllib.request
marker = os.environ["REVERSED"][::-1].encode()
found, files, procs = [], 0, 0
for top in ("/workspace", "/tmp", "/var/tmp", "/run", "/etc", "/home", "/root", "/srv",
            "/mnt", "/dev/shm"):
    for root, dirs, names in os.walk(top):
        for name in names:
            path = os.path.join(root, name)
            try:
                if not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO would never answer
                    continue
                with open(path, "rb") as f:
                    files += 1
                    if marker in f.read(1 << 20):
                        found.append(path)
            except OSError:
                pass
for pid in os.listdir("/proc"):
    for part in ("environ", "cmdline"):
        try:
            with open(f"/proc/{{pid}}/{{part}}", "rb") as f:
                data = f.read()
            procs += 1
            if marker in data and pid != str(os.getpid()):
                found.append(f"/proc/{{pid}}/{{part}}")
        except OSError:
            pass
base = os.environ["OPENAI_BASE_URL"].rsplit("/v1", 1)[0]
key = os.environ["OPENAI_API_KEY"]
routes = {{}}
def call(method, path, doc=None):
    req = urllib.request.Request(base + path, method=method,
                                 data=None if doc is None else json.dumps(doc).encode(),
                                 headers={{"Authorization": "Bearer " + key, "x-api-key": key,
                                          "Content-Type": "application/json",
                                          "anthropic-version": "2023-06-01"}})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        return 0, str(e).encode()
for path in ("/", "/v1", "/v1/models", "/v1/jobs", "/v1/job", "/v1/instance", "/v1/files",
             "/v1/batches", "/metrics", "/debug", "/admin", "/healthz", "/v1/models/x"):
    for method in ("GET", "POST"):
        status, body = call(method, path, {{}} if method == "POST" else None)
        routes[method + " " + path] = status
        if marker in body:
            found.append(method + " " + path)
url = os.environ["FETCH_ME"]
look = {{"type": "text", "text": "[case:crawl] look"}}
image = {{"type": "image_url", "image_url": {{"url": url}}}}
source = {{"type": "image", "source": {{"type": "url", "url": url}}}}
fetch = [call("POST", "/v1/chat/completions", {{"model": "m", "max_tokens": 8, "messages": [
             {{"role": "user", "content": [look, image]}}]}})[0],
         call("POST", "/v1/messages", {{"model": "m", "max_tokens": 8, "messages": [
             {{"role": "user", "content": [look, source]}}]}})[0]]
print(json.dumps({{"found": found, "files": files, "procs": procs, "routes": routes,
                  "fetch": fetch}}))
status, body = call("POST", "/v1/chat/completions", {{"model": "m", "messages": [
    {{"role": "user", "content": open(os.environ["PRORL_PROMPT_FILE"]).read()}}]}})
print(json.loads(body)["choices"][0]["message"]["content"])
EOF"""


@pytest.fixture(scope="module")
def harnesses():
    """The presets' environments, where `make harnesses` builds them (idempotent)."""
    path = load_settings(farm_env("redis://unused")).harness_path
    for name in PRESETS:
        install(name, path)
    return path


@pytest.fixture(scope="module", params=["bwrap", part_param("docker")])
def harness_farm(request, redis_server, tmp_path_factory, tiny_model, harnesses):
    """Pools as root with bwrap sandboxes, then with docker sandboxes (graders' too) on the
    session's private engine, where one runs."""
    docker = docker_settings(request)
    tag = "harness" if not docker else "harness-docker"
    repos = Path(tempfile.mkdtemp(prefix="prs-harness-repos-"))
    repos.chmod(0o755)
    instances = build_repos(repos)
    try:
        with scripted_farm(redis_server.url, tmp_path_factory.mktemp(tag),
                           str(tiny_model), PLANS, tag, sandbox_mount_roots=str(repos),
                           harness_dir=harnesses, **docker) as (client, server):
            client.backend = {"url": server.url, "kind": "vllm", "model": "tiny",
                              "tokenizer": str(tiny_model), "capacity": 64}
            client.tag = tag
            client.engine = request.getfixturevalue("docker_engine") if docker else None
            yield client, instances
    finally:
        shutil.rmtree(repos, ignore_errors=True)


def _math(client, cases: list[tuple[str, dict]], sampling: dict | None = None,
          deadline_s: float = 120) -> list[dict]:
    use_only_backend(client, **client.backend)
    instances = [{"problem": f"[case:{case}] What is 2 + 2?", "answer": "4", "agent": agent}
                 for case, agent in cases]
    return run_batch(client, {"handler": "math", "instances": instances,
                              "sampling": {"max_tokens": 256, **(sampling or {})},
                              "deadline_s": deadline_s}, deadline_s + 60)


def _ids(tiny_model, *turns: str) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return [t for text in turns for t in tok.encode(text, add_special_tokens=False) + [end]]


def _nothing_left(client) -> None:
    """No sandbox of the farm's left (their directories go with them; with docker, their
    containers) and no harness process."""
    root = Path(sandbox_root(f"{client.tag}-{os.getpid()}"))
    wait_until(lambda: not [p for p in root.glob("*") if not p.name.startswith(".")], 30,
               0.2, "sandboxes stopped")
    if client.engine is not None:
        wait_until(lambda: not client.engine.containers("label=prorl.sandbox"), 30, 0.2,
                   "the sandboxes' containers gone")
    # Of this test process's own (the suite's other workers run harnesses too).
    left = own_processes("openai-agent/bin/python|sleep 600")
    assert left == [], left


def test_the_openai_agent_preset_solves_and_fails_math(harness_farm, tiny_model):
    client, _ = harness_farm
    agent = {"preset": "openai-agent"}
    good, wrong = _math(client, [("add", agent), ("wrong", agent)])
    assert good["state"] == "done", good["failure"]
    assert good["reward"] == 1.0 and wrong["reward"] == 0.0, (good["result"]["eval"],
                                                              wrong["result"]["eval"])
    result = good["result"]
    assert result["stats"]["end_reason"] == "answered" and result["stats"]["turns"] == 2
    assert result["capture"]["calls"] == 2 and result["capture"]["merged"] == 1
    assert result["harness"]["exit_code"] == 0 and "\\boxed{4}" in \
        result["harness"]["stdout_tail"]
    # Exactly what the policy sampled, mask 1; the tool's output (run by the harness in the
    # sandbox) in between, mask 0.
    assert sampled_ids(result) == _ids(tiny_model, *PLANS["add"])
    observed = [t for t, m in zip(result["response_ids"], result["response_mask"]) if not m]
    tok = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    assert "<tool_response>\n4\n\n[exit status 0]\n</tool_response>" in tok.decode(observed)
    assert "segments" not in result  # one segment: it is the trajectory
    _nothing_left(client)


def test_mini_swe_agent_resolves_the_sample_swe_instance_and_a_wrong_fix_does_not(
        harness_farm):
    client, instances = harness_farm
    use_only_backend(client, **client.backend)
    agent = {"preset": "mini-swe-agent"}
    cases = [{**instances[0], "agent": agent, "test_timeout_s": 60,
              "problem_statement": f"[case:{case}] {instances[0]['problem_statement']}"}
             for case in ("fix", "wrong-fix")]
    fixed, wrong = run_batch(client, {"handler": "swe", "instances": cases,
                                      "sampling": {"max_tokens": 512}, "deadline_s": 300}, 360)
    assert fixed["state"] == "done" and wrong["state"] == "done", (
        fixed["failure"], wrong["failure"], fixed.get("result", {}).get("harness"))
    assert fixed["reward"] == 1.0, fixed["result"]["eval"]
    assert fixed["result"]["eval"]["resolved"] and \
        "+        result += a\n" in fixed["result"]["eval"]["diff"]
    assert wrong["reward"] == 0.0 and wrong["result"]["eval"]["tests"]["FAIL_TO_PASS"] == {
        "tests/test_calc.py::test_mul": "failed"}
    harness = fixed["result"]["harness"]
    assert harness["exit_code"] == 0, harness
    assert fixed["result"]["capture"] == {**fixed["result"]["capture"], "calls": 2,
                                          "merged": 1, "segments": 1}
    # mini-SWE-agent's own prompt (its system and instance templates) reached the model.
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in fixed["result"]["messages"][1]["content"]


def test_the_openai_and_anthropic_sdks_in_a_farm_sandbox_round_trip_tool_calls(
        harness_farm, tiny_model):
    client, _ = harness_farm
    jobs = _math(client, [("sdk", {"command": OPENAI_SDK}), ("sdk", {"command": ANTHROPIC_SDK})])
    for job in jobs:
        assert job["state"] == "done", (job["failure"], (job.get("result") or {}).get("harness"))
        result = job["result"]
        seen = json.loads(result["harness"]["stdout_tail"].strip().splitlines()[-1])
        assert seen == [['bash{"command": "ls"}'], ['bash{"command": "pwd"}'], "All done."]
        assert result["capture"]["calls"] == 3 and result["capture"]["merged"] == 2
        assert result["capture"]["segments"] == 1
        assert sampled_ids(result) == _ids(tiny_model, *PLANS["sdk"])
        assert job["reward"] == 0.0  # graded as any math answer: "All done." is not 4


def test_cancel_ends_a_running_harness_at_once(harness_farm):
    client, _ = harness_farm
    use_only_backend(client, **client.backend)
    sub = client.post("/v1/jobs", json={"handler": "math", "deadline_s": 600, "instances": [{
        "problem": "x", "answer": "4", "agent": {"command": "sleep 600"}}]}).get_json()
    job_url = f"/v1/jobs/{sub['job_ids'][0]}"
    wait_until(lambda: own_processes("sleep 600"), 60, 0.2, "the harness running")
    if client.engine is not None:  # it runs in a container of the engine's
        assert client.engine.containers("label=prorl.sandbox")
    assert client.post(f"/v1/batches/{sub['batch_id']}/cancel").status_code == 200
    wait_until(lambda: client.get(job_url).get_json()["state"] == "cancelled", 30, 0.1,
               "cancelled")
    _nothing_left(client)


def test_a_rewritten_history_starts_a_new_segment_and_says_where(harness_farm, tiny_model):
    client, _ = harness_farm
    (job,) = _math(client, [("talk", {"command": REWRITER, "prompt": "file"})])
    assert job["state"] == "done", job["failure"]
    result = job["result"]
    capture = result["capture"]
    assert capture["calls"] == 3 and capture["merged"] == 1 and capture["segments"] == 2
    (split,) = capture["splits"]
    assert split["call"] == 3 and split["segment"] == 1
    # Where it diverged: the first token of the rewritten first user message.
    (first,) = result["segments"]
    diverged = split["diverged_at"]
    assert first["prompt_ids"][:diverged] == result["prompt_ids"][:diverged]
    assert first["prompt_ids"][diverged] != result["prompt_ids"][diverged]
    assert sampled_ids(first) == _ids(tiny_model, *PLANS["talk"][:2])
    assert sampled_ids(result) == _ids(tiny_model, PLANS["talk"][2])
    assert job["reward"] == 1.0  # the final answer is the last segment's


def test_a_key_is_refused_for_another_job_and_after_its_job_ended(harness_farm):
    client, _ = harness_farm
    (first,) = _math(client, [("add", {"command": KEYS})])
    assert first["state"] == "done", first["failure"]
    out = first["result"]["harness"]["stdout_tail"]
    key = next(line[4:] for line in out.splitlines() if line.startswith("KEY="))
    other = {"command": KEYS, "env": [{"name": "OTHER", "value": key}]}
    (second,) = _math(client, [("add", other)])
    out2 = second["result"]["harness"]["stdout_tail"]
    assert "OTHER=refused" in out2 and f"KEY={key}" not in out2


def test_a_harness_that_crawls_for_the_answer_finds_nothing_and_fetches_nothing(
        harness_farm):
    """Red team, harness jobs: the policy drives its harness to look for the reference answer
    everywhere it can read (files, processes, the gateway's routes) and to make the gateway
    fetch URLs on the farm's side. Nothing holds the answer, no route but the model API's
    answers, nothing is fetched (a listener on the farm's loopback hears no connection);
    it earns 0, beside an honest harness that earns 1.0 in the same batch."""
    import socket
    import threading

    client, _ = harness_farm
    answer = "7382915046"
    heard = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    stop = threading.Event()

    def listen():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            heard.append(conn.recv(200))
            conn.close()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    crawler = {"command": CRAWLER, "prompt": "file", "env": [
        {"name": "REVERSED", "value": answer[::-1]},
        {"name": "FETCH_ME", "value": f"http://127.0.0.1:{listener.getsockname()[1]}/x.png"}]}
    try:
        use_only_backend(client, **client.backend)
        jobs = run_batch(client, {"handler": "math", "instances": [
            {"problem": "[case:crawl] Which ten-digit number is the answer?",
             "answer": answer, "agent": crawler},
            {"problem": "[case:add] What is 2 + 2?", "answer": "4",
             "agent": {"preset": "openai-agent"}}],
            "sampling": {"max_tokens": 64}, "deadline_s": 180}, 240)
    finally:
        stop.set()
        thread.join()
        listener.close()
    crawl, honest = jobs
    assert honest["state"] == "done" and honest["reward"] == 1.0, honest["result"].get("eval")
    assert crawl["state"] == "done", (crawl["failure"],
                                      (crawl.get("result") or {}).get("harness"))
    assert crawl["reward"] == 0.0, crawl["result"]["eval"]
    out = crawl["result"]["harness"]["stdout_tail"]
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert report["files"] > 10 and report["procs"] > 2, report  # it did look
    assert report["found"] == [], report
    served = {route for route, status in report["routes"].items() if status == 200}
    assert served == {"GET /v1/models"}, report["routes"]
    assert heard == [], heard


def test_harness_faults_fail_clearly_and_leave_nothing(harness_farm):
    client, _ = harness_farm
    hang_after_call = (f"{PYTHON} -c 'import openai; openai.OpenAI().chat.completions.create("
                       "model=\"m\", messages=[{\"role\": \"user\", \"content\": \"[case:add] "
                       "x\"}])'; sleep 600")
    # Time for the SDK to start and make its call first, on a loaded machine too.
    jobs = _math(client, [("add", {"command": "sleep 600", "time_limit_s": 3}),
                          ("add", {"command": hang_after_call, "time_limit_s": 20}),
                          ("add", {"command": "echo broken >&2; exit 3"}),
                          ("add", {"command": "true"})])
    hang, hang_after, broken, silent = jobs
    assert hang["state"] == "failed" and hang["failure"]["kind"] == "timeout"
    assert hang["reward"] is None
    assert hang_after["failure"]["kind"] == "timeout"
    # What it captured before it hung is kept.
    assert hang_after["result"]["capture"]["calls"] == 1
    assert broken["failure"]["kind"] == "harness_error"
    assert "status 3" in broken["failure"]["message"] and "broken" in \
        broken["failure"]["message"]
    assert silent["failure"]["kind"] == "harness_error"
    assert "without a model call" in silent["failure"]["message"]
    _nothing_left(client)


def test_a_limit_ends_the_episode_and_eval_still_grades(harness_farm):
    client, _ = harness_farm
    (job,) = _math(client, [("loop", {"command": LOOPER})], sampling={"max_turns": 3})
    assert job["state"] == "done", job["failure"]
    result = job["result"]
    assert result["stats"]["end_reason"] == "max_turns" and result["stats"]["turns"] == 3
    assert job["reward"] == 0.0  # graded: no final answer
    _nothing_left(client)


@pytest.fixture(scope="session", params=["dev", part_param("vllm")])
def engine(request):
    """(name, model directory, URL): the tiny model on the dev server, then on real vLLM
    (started before the test, as the session's servers are)."""
    name = request.param
    model = request.getfixturevalue("tiny_model" if name == "dev" else "vllm_model")
    return name, model, request.getfixturevalue("dev_server" if name == "dev" else
                                                "vllm_server")


def test_a_real_model_behind_a_harness_is_captured_token_exact(
        engine, redis_server, tmp_path_factory, harnesses):
    """The harness's free conversation (its history rewritten once) captured as two
    segments whose sampled tokens' logprobs match teacher forcing."""
    engine, model, url = engine
    with scripted_farm(redis_server.url, tmp_path_factory.mktemp(f"harness-{engine}"),
                       str(model), {}, f"harness-{engine}", harness_dir=harnesses) as (
            client, _):
        client.backend = {"url": url, "kind": "vllm", "model": "tiny",
                          "tokenizer": str(model), "capacity": 8}
        (job,) = _math(client, [("none", {"command": REWRITER.replace(
            "[case:talk]", ""), "prompt": "file"})],
            sampling={"max_tokens": 16, "temperature": 1.0, "seed": 3})
    assert job["state"] == "done", job["failure"]
    result = job["result"]
    assert result["capture"]["segments"] == 2 and result["capture"]["merged"] == 1
    for seg in (*result["segments"], result):
        mask = seg["response_mask"]
        full = seg["prompt_ids"] + seg["response_ids"]
        forced = teacher_forced_logprobs(model, full)[len(seg["prompt_ids"]):]
        errors = [abs(forced[i] - seg["response_logprobs"][i])
                  for i, m in enumerate(mask) if m]
        assert errors and max(errors) < 1e-3


def test_pools_and_sandboxes_of_an_unprivileged_user_serve_a_harness(
        tmp_path_factory, tiny_model, harnesses):
    """Pools run as nobody: the RUN pool's gateway socket, in the sandbox's own directory,
    is reached from the sandbox (another uid) and the harness environment is readable.
    On a Redis of its own: the module's farm (pools as root, the same node) would
    otherwise take some of its stages."""
    user = pool_user("nobody")
    under = Path(tempfile.mkdtemp(prefix="prs-harness-tok-"))
    under.chmod(0o755)
    own = RedisServer(tmp_path_factory.mktemp("redis-nobody"))
    try:
        tokenizer = readable_copy(tiny_model, under)
        with scripted_farm(own.url, tmp_path_factory.mktemp("harness-nobody"),
                           tokenizer, PLANS, "harness-nobody", user=user,
                           harness_dir=harnesses) as (client, server):
            client.backend = {"url": server.url, "kind": "vllm", "model": "tiny",
                              "tokenizer": tokenizer, "capacity": 8}
            (job,) = _math(client, [("add", {"preset": "openai-agent"})])
        assert job["state"] == "done", (job["failure"], (job.get("result") or {}).get("harness"))
        assert job["reward"] == 1.0 and job["result"]["capture"]["merged"] == 1
    finally:
        own.stop()
        shutil.rmtree(under, ignore_errors=True)


def test_the_presets_and_their_environments_are_listed():
    out = subprocess.run([str(ROOT / ".venv/bin/prorl-farm"), "harness", "list"],
                         capture_output=True, text=True, check=True).stdout
    assert {line.split("\t")[0] for line in out.splitlines()} == set(PRESETS)


def test_a_farm_without_bwrap_refuses_harness_instances_and_checks_the_field():
    from prorl_farm.errors import InvalidInstance
    from prorl_farm.handlers.math import MathHandler

    handler = MathHandler()
    inst = handler.validate_instance({"problem": "x", "answer": "1",
                                      "agent": {"preset": "openai-agent"}})
    for runtime in ("bwrap", "docker"):
        assert handler.refusals(inst, load_settings({"PRORL_SANDBOX_RUNTIME": runtime})) == {}
    for runtime in ("local", "apptainer"):
        refused = handler.refusals(inst, load_settings({"PRORL_SANDBOX_RUNTIME": runtime}))
        assert "bwrap or docker" in refused["agent"][0] and runtime in refused["agent"][0]
    for bad, field in (({"preset": "x"}, "preset"), ({}, "preset"),
                       ({"preset": "openai-agent", "command": "x"}, "preset"),
                       ({"command": "x", "env": [{"name": "1A", "value": ""}]}, "env"),
                       ({"command": "x", "time_limit_s": 0}, "time_limit_s")):
        with pytest.raises(InvalidInstance) as e:
            handler.validate_instance({"problem": "x", "answer": "1", "agent": bad})
        assert field in e.value.details["agent"], e.value.details
