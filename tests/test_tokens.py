"""Token-in/token-out: drift of decode->encode, and trajectories that reproduce exactly what
the backend sampled, checked against a teacher-forced forward pass of the same model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import requests

from api import create_app
from prorl_farm.agent.trajectory import ChatTokens, TokenMismatch, Trajectory
from prorl_farm.config import load_settings
from prorl_farm.llm.session import turn_seed
from tests.conftest import make_pools
from tests.farm import farm_env, wait_until

pytestmark = pytest.mark.slow

LLAMA3_LIKE = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content']"
    " + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}{{ '[SYS]You are helpful.[/SYS]' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '[assistant]' + m['content'] + '</s>' }}"
    "{% else %}{{ '[' + m['role'] + ']' + m['content'] + '[/' + m['role'] + ']' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '[assistant]' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.mark.parametrize("template", [None, LLAMA3_LIKE, DEFAULT_SYSTEM],
                         ids=["chatml", "llama3-like", "default-system"])
def test_glue_matches_a_full_render_for_any_template(tokenizer, template):
    import copy

    tok = copy.deepcopy(tokenizer)
    if template:
        tok.chat_template = template
    chat = ChatTokens(tok)
    messages = [{"role": "user", "content": "2+2?"}]
    traj = Trajectory.start(chat, messages)
    eos_text = "</s>" if template == DEFAULT_SYSTEM else None
    for turn, text in enumerate(["It is 4.", "Yes, sure."]):
        sampled = chat.encode_text(text + (eos_text or ""))
        stop = "stop"
        if template is None:
            sampled.append(tok.eos_token_id)  # ChatML: the model samples <|im_end|> itself
        elif template == LLAMA3_LIKE:
            stop = "length"  # the model never closed its turn: the glue must close it
        traj.add_generation(traj.context(), sampled, [-1.0] * len(sampled), stop, "b", "0",
                            "raw_logprobs")
        messages = messages + [{"role": "assistant", "content": text},
                               {"role": "user", "content": f"and {turn}?"}]
        traj.add_messages(messages[-1:])
        expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.decode(traj.context(), skip_special_tokens=False) == expected
    assert traj.response_mask.count(1) == sum(t["generated"] for t in traj.turns)


def test_observations_are_encoded_as_the_tokenizer_encodes_them(tokenizer):
    """The glue takes the tokenizers backend directly only where it agrees with the
    tokenizer's own encode; a tokenizer whose backend disagrees keeps its own path."""
    import copy

    chat = ChatTokens(tokenizer)
    assert chat._backend is not None
    for text in ["<tool_response>\n  x = 1\n</tool_response><|im_end|>\n", "\u00e9\t\r\n  ",
                 "<|endoftext|>a<|im_start|>assistant\n"]:
        assert chat.encode_text(text) == tokenizer.encode(text, add_special_tokens=False)

    tok = copy.deepcopy(tokenizer)
    real = tok._tokenizer

    class Skewed:  # a backend that drops a token, as a tokenizer with Python-side steps would
        def encode(self, text, add_special_tokens=False):
            enc = real.encode(text, add_special_tokens=add_special_tokens)
            return SimpleNamespace(ids=enc.ids[1:])

    skewed = ChatTokens.__new__(ChatTokens)
    assert skewed._direct_backend(SimpleNamespace(
        _tokenizer=Skewed(), encode=tok.encode, all_special_tokens=[])) is None
    assert skewed._direct_backend(SimpleNamespace(
        _tokenizer=real, encode=tok.encode, all_special_tokens=tok.all_special_tokens,
        split_special_tokens=True)) is None


def test_prefix_invariant_is_enforced(tokenizer):
    chat = ChatTokens(tokenizer)
    traj = Trajectory.start(chat, [{"role": "user", "content": "hi"}])
    with pytest.raises(TokenMismatch):
        traj.add_generation(traj.context()[:-1], [5], [-1.0], "stop", "b", "0", "raw")


def test_decode_encode_drifts_but_ids_come_back_exact(dev_server, tokenizer):
    """Re-tokenising sampled text changes the IDs in a measurable share of samples; the
    server's token IDs, taken as they are, do not."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "def f(x):"}],
                                           tokenize=True, add_generation_prompt=True,
                                           return_dict=False)
    drifted = 0
    n = 60
    for seed in range(n):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "seed": seed,
                "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
                "ignore_eos": True}
        choice = requests.post(dev_server + "/v1/completions", json=body, timeout=30
                               ).json()["choices"][0]
        ids = choice["token_ids"]
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer.encode(text, add_special_tokens=False) != ids:
            drifted += 1
        again = requests.post(dev_server + "/v1/completions", json=body, timeout=30).json()
        assert again["choices"][0]["token_ids"] == ids  # seeded sampling is reproducible
    assert drifted / n >= 0.1, f"only {drifted}/{n} sequences drifted"


@pytest.fixture(scope="module")
def chat_farm(redis_server, tmp_path_factory, dev_server, tiny_model):
    pools = make_pools(redis_server, tmp_path_factory.mktemp("chat"), run_concurrency=8)
    pools.start()
    client = create_app(load_settings(farm_env(redis_server.url))).test_client()
    yield pools, client
    pools.stop()


def teacher_forced_logprobs(model_dir, ids: list[int]) -> list[float]:
    """Each token's logprob given those before it (0.0 for the first), under the model at
    ``model_dir`` or an already loaded one."""
    import torch
    from transformers import AutoModelForCausalLM

    model = model_dir if isinstance(model_dir, torch.nn.Module) else \
        AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [0.0] + [float(logp[p - 1, ids[p]]) for p in range(1, len(ids))]


# Many stop tokens, so that some turns stop early and others run to max_tokens.
STOPS = list(range(300, 500))


def resample(url: str, kind: str, prompt: list[int], n: int, seed: int):
    """The same request the farm made, by hand: (token ids, logprobs)."""
    if kind == "vllm":
        choice = requests.post(url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": n, "seed": seed, "temperature": 1.0, "top_p": 0.95,
            "logprobs": 0, "return_token_ids": True, "stop_token_ids": STOPS},
            timeout=30).json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]
    doc = requests.post(url + "/generate", json={
        "input_ids": prompt, "return_logprob": True, "sampling_params": {
            "max_new_tokens": n, "sampling_seed": seed, "temperature": 1.0, "top_p": 0.95,
            "stop_token_ids": STOPS}},
        timeout=30).json()
    rows = doc["meta_info"]["output_token_logprobs"]
    return [row[1] for row in rows], [row[0] for row in rows]


def test_farm_trajectories_are_token_exact(chat_farm, dev_server, tiny_model, r):
    pools, client = chat_farm
    r.delete("prorl:backends:all")
    ids = {}
    for kind in ("vllm", "sglang"):
        resp = client.post("/v1/backends", json={
            "url": dev_server, "kind": kind, "model": "tiny", "tokenizer": str(tiny_model),
            "capacity": 4, "policy_version": {"vllm": 11, "sglang": 12}[kind],
            "logprobs_mode": "raw_logprobs"})
        ids[resp.get_json()["id"]] = kind
    instances = [{"messages": [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": f"def f{i}(x):"}],
                  "observations": ["Traceback: NameError", "ok, again"],
                  "observation_role": "tool" if i else "user", "continue_on_length": True}
                 for i in range(2)]
    resp = client.post("/v1/jobs", json={"handler": "chat", "instances": instances, "n": 4,
                                         "sampling": {"temperature": 1.0, "max_tokens": 16,
                                                      "seed": 11, "top_p": 0.95,
                                                      "stop_token_ids": STOPS}})
    assert resp.status_code == 202, resp.get_json()
    sub = resp.get_json()
    wait_until(lambda: client.get(f"/v1/batches/{sub['batch_id']}").get_json()["complete"],
               120, 0.2, "chat batch")
    jobs = [client.get(f"/v1/jobs/{i}").get_json() for i in sub["job_ids"]]
    assert [j["state"] for j in jobs] == ["done"] * 8, [j["failure"] for j in jobs]
    kinds_used = set()
    for job in jobs:
        t = job["result"]
        resp_ids, mask, lps = t["response_ids"], t["response_mask"], t["response_logprobs"]
        assert len(resp_ids) == len(mask) == len(lps)
        assert len({turn["backend"] for turn in t["turns"]}) == 1  # sticky
        kind = ids[t["turns"][0]["backend"]]
        kinds_used.add(kind)
        # Teacher forcing the whole trajectory gives back the recorded logprobs.
        full = t["prompt_ids"] + resp_ids
        forced = teacher_forced_logprobs(tiny_model, full)[len(t["prompt_ids"]):]
        sampled = [i for i, m in enumerate(mask) if m]
        assert sampled, "no sampled tokens"
        assert max(abs(forced[i] - lps[i]) for i in sampled) < 1e-4
        assert all(lps[i] == 0.0 for i, m in enumerate(mask) if not m)
        for turn in t["turns"]:
            off, n = turn["offset"], turn["generated"]
            assert mask[off:off + n] == [1] * n
            assert turn["policy_version"] == {"vllm": 11, "sglang": 12}[kind]
            assert turn["logprobs_mode"] == "raw_logprobs" and turn["prefix_checked"]
            # Asking the server again with the same prompt and seed gives the same IDs and
            # logprobs: the trajectory holds exactly what was sampled. (Logprobs to fp32
            # rounding: the server batches concurrent requests, and a padded batch's
            # numerics differ in the last bits, as on vLLM.)
            again = resample(dev_server, kind, full[:len(t["prompt_ids"]) + off], n,
                             turn_seed(SimpleNamespace(sampling={"seed": 11}, **{
                                 k: job[k] for k in ("instance_index", "sample_index")}),
                                 t["turns"].index(turn)))
            assert again[0] == resp_ids[off:off + n]
            assert max(abs(a - b) for a, b in zip(again[1], lps[off:off + n])) < 1e-5
        assert len(t["turns"]) >= 1 and t["messages"][0]["content"] == "Be brief."
    assert kinds_used == {"vllm", "sglang"}
    turns = [len(j["result"]["turns"]) for j in jobs]
    finishes = {turn["finish_reason"] for j in jobs for turn in j["result"]["turns"]}
    assert max(turns) == 3 and finishes == {"stop", "length"}
    # The trainer layouts, on these real trajectories: log-probs sit where teacher forcing
    # the padded rows' real tokens puts them, masks on exactly the sampled tokens.
    from prorl_farm.trainer.adapters import to_verl

    groups = [[j for j in jobs if j["instance_index"] == i] for i in range(2)]
    # (These backends return raw logprobs and the sampling has top_p 0.95: a trainer computing
    # raw logprobs, as this check does, says so; VeRL's default would be refused.)
    verl = to_verl(groups, pad_token_id=0, logprobs_mode="raw_logprobs")["batch"]
    width = verl["prompts"].shape[1]
    for row, job in enumerate(groups[0] + groups[1]):
        t = job["result"]
        real = verl["input_ids"][row][verl["attention_mask"][row] == 1].tolist()
        assert real == t["prompt_ids"] + t["response_ids"]
        assert verl["prompts"][row, :width - len(t["prompt_ids"])].sum() == 0  # left pad
        forced = teacher_forced_logprobs(tiny_model, real)[len(t["prompt_ids"]):]
        mask = verl["response_mask"][row]
        for j in range(len(t["response_ids"])):
            if mask[j]:
                assert abs(forced[j] - verl["rollout_log_probs"][row, j]) < 1e-4
