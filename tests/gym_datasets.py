"""NeMo Gym's shipped environments, each as it comes, through ``ng_collect_rollouts``, the
farm and the environment's own resources server; shared by tests/test_gym.py (a few) and
bench/gym_datasets.py (every one, its table recorded).

An environment of nemo-gym 0.7.0 ships ``resources_servers/ENV``: its server (``app.py``),
its config and ``data/example.jsonl`` (the rows), and ``data/example_rollouts.jsonl``: the
rows run by a real model, each with its response and the reward Gym's own server gave it.
For each environment:

- the rows of ``example.jsonl`` that have a recorded rollout (one per distinct input) are
  the cases; the policy (a replay of the recorded model, :class:`Replay`) answers each
  with the recorded turns: the right pass. The wrong pass answers every row with one
  scripted wrong text;
- the environment's server runs from Gym's code (tests/gym_side.py serve), and a
  ``prorl-farm gym --resources-server`` sends every row to it as a ``gym`` job;
- Gym's ``ng_collect_rollouts`` runs the rows through the farm; its output rows are checked
  with Gym's ``BaseVerifyResponse``;
- the farm's reward of each row is compared with Gym's own verdict on the same answer:
  for a row without tools, the environment's ``/seed_session`` and ``/verify`` called
  directly with the answer as Gym's agent sends it (the recorded response for the right
  pass, the wrong text as a message for the wrong one); for a row with tools (whose verdict
  needs the session the tool calls built), the recorded reward, and the seeded session's
  verdict on the wrong text.

An environment that cannot run here says why (:func:`run_env`'s ``reason``): a package it
needs that is not installed, the network, a model server its verifier calls (a judge).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from prorl_farm.gym.rows import RowError, messages_of

ROOT = Path(__file__).resolve().parent.parent
GYM_PYTHON = ROOT / ".venv-gym" / "bin" / "python"
GYM_SIDE = str(ROOT / "tests" / "gym_side.py")
ENVS = ROOT / ".venv-gym" / "lib" / "python3.13" / "site-packages" / "resources_servers"
WRONG = "I cannot answer this."
# What an environment's call of a model server (a judge, a user or tool simulator) gives
# here, where the server's ServerClient reaches nothing.
NO_MODEL = ("Input must be bytes, bytearray, memoryview, or str", "AsyncMock", "MagicMock")
NO_MODEL_SAYS = "it calls a model server (a judge or a simulator), none here"
VERDICT_S = 90.0  # how long Gym's own verdict on one answer may take


def _plain(reason: str) -> str:
    return NO_MODEL_SAYS if any(m in reason for m in NO_MODEL) else reason
# What a recorded rollout holds beside its row (the row's own task fields are kept).
RECORDED = ("response", "reward", "agent_ref", "mask_sample", "failure_kind", "failure_reason")


def tool_call(name: str, arguments: str) -> str:
    """A hermes-format tool call of a recorded function call (its arguments as recorded)."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        args = arguments
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def turns_of(output: list[dict]) -> list[str]:
    """A recorded response's model calls as the texts a policy writes: each call's message
    text, then its function calls in hermes form (its reasoning left out). A call ends
    where the tool results of its calls end."""
    turns: list[list[str]] = [[]]
    closing = False
    for item in output:
        kind = item.get("type")
        if kind == "function_call_output":
            closing = True
            continue
        if closing:
            turns.append([])
            closing = False
        if kind == "message" and item.get("role", "assistant") == "assistant":
            content = item.get("content")
            text = content if isinstance(content, str) else "".join(
                p.get("text") or "" for p in content or [] if isinstance(p, dict))
            if text.strip():
                turns[-1].append(text)
        elif kind == "function_call":
            turns[-1].append(tool_call(item.get("name", ""), item.get("arguments", "")))
    return ["\n".join(t) for t in turns if t]


def _texts(row: dict) -> list[tuple[str, str]]:
    """(role, text) of the row's input messages."""
    params = row.get("responses_create_params") or {}
    raw = params.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw or []
    out = []
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
        if isinstance(content, str):
            out.append((item.get("role") or "user", content))
    return out


def key_of(row: dict) -> str:
    """The text that tells a row's prompt apart: the end of its last user message (of its
    longest text when it has none)."""
    texts = _texts(row)
    users = [t for role, t in texts if role == "user" and t.strip()]
    if users:
        return users[-1][-160:]
    return max((t for _, t in texts), key=len)[-160:] if texts else ""


@dataclass
class Case:
    row: dict  # as example.jsonl ships it
    turns: list[str]  # the recorded model's calls
    recorded: float  # the reward Gym's server gave them
    response: dict  # the recorded response
    tools: bool = field(init=False)

    def __post_init__(self):
        self.tools = bool((self.row.get("responses_create_params") or {}).get("tools"))


def cases(env: str, limit: int = 0) -> tuple[list[Case], str]:
    """The environment's rows that have a recorded rollout (one per distinct prompt), or
    ([], why none)."""
    data = ENVS / env / "data"
    try:
        rows = [json.loads(line) for line in (data / "example.jsonl").read_text().splitlines()
                if line.strip()]
        recorded = [json.loads(line) for line in
                    (data / "example_rollouts.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        return [], f"its example data does not load ({type(e).__name__})"
    by_key: dict[str, dict] = {}  # the recorded rows (Gym's normalised copies of the input)
    for r in recorded:
        if isinstance(r.get("response"), dict) and isinstance(r.get("reward"), (int, float)):
            by_key.setdefault(key_of(r), r)
    def pick(candidates: list[dict]) -> list[Case]:
        out, keys = [], set()
        for row in candidates:
            key = key_of(row)
            rec = by_key.get(key)
            if rec is None or not key or any(key in k or k in key for k in keys):
                continue
            turns = turns_of(rec["response"].get("output") or [])
            if not turns:
                continue
            keys.add(key)
            out.append(Case(row, turns, float(rec["reward"]), rec["response"]))
            if limit and len(out) >= limit:
                break
        return out

    out = pick(rows)
    fields = set().union(*(set(r) for r in rows)) if rows else set()
    if not out:  # the recordings are of other rows: the recorded rows themselves, as sent,
        # when they carry the task fields the example rows do
        out = pick([{k: v for k, v in r.items() if k not in RECORDED and not k.startswith(
            "_ng_")} for r in by_key.values() if fields <= set(r)])
    if out:
        return out, ""
    if not rows:
        return [], "no example rows"
    # Nothing to replay: the example rows for the wrong pass alone.
    out, keys = [], set()
    for row in rows:
        key = key_of(row)
        if key and not any(key in k or k in key for k in keys):
            keys.add(key)
            out.append(Case(row, [], math.nan, {}))
        if limit and len(out) >= limit:
            break
    if not out:
        return [], "its rows hold no prompt text (the environment makes the prompt itself)"
    return out, "no recorded rollout of these rows to replay: the wrong pass only"


class Replay:
    """The policy: the recorded model's calls for the row its prompt is (found by its
    key), turn by turn; in the wrong pass, one scripted wrong text."""

    def __init__(self, tokenizer_path: str, end_token: str = "<|im_end|>"):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        self.end = self.tok.convert_tokens_to_ids(end_token)
        self.end_text = end_token
        self.lock = threading.Lock()
        self.cases: list[Case] = []
        self.wrong = False

    def case(self, text: str) -> Case | None:
        """The row the prompt is: its key closing a message (a key met elsewhere, such as
        in a tool's output, is another row's text quoted)."""
        for case in self.cases:
            if key_of(case.row) + self.end_text in text:
                return case
        for case in self.cases:
            if key_of(case.row) in text:
                return case
        return None

    def __call__(self, prompt: list[int], max_tokens: int):
        """The planner's answer, or None: not a row of these cases."""
        with self.lock:
            text = self.tok.decode(prompt, skip_special_tokens=False)
        case = self.case(text)
        if case is None:
            return None
        turns = [WRONG] if self.wrong else case.turns
        # The model's calls so far: the assistant turns of the prompt past the row's own
        # (its messages as the farm renders them: function calls make assistant turns).
        try:
            before = sum(m["role"] == "assistant" for m in messages_of(
                case.row["responses_create_params"]))
        except RowError:
            before = 0
        turn = max(0, text.count("<|im_start|>assistant") - 1 - before)
        answer = turns[turn] if turn < len(turns) else "I am done."
        with self.lock:
            ids = list(self.tok.encode(answer, add_special_tokens=False))
        ids.append(self.end)
        return (ids[:max_tokens], "length") if len(ids) > max_tokens else (ids, "stop")


def _up(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code < 500
    except OSError:
        return False


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[A-Za-z_.]+(Error|Exception|Exit)\b", ln)]
    return (errors or lines or ["it exited"])[-1][:200]


class EnvServer:
    """The environment's resources server, from Gym's code, on ``port``."""

    def __init__(self, env: str, port: int, log: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.slow = ""
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([str(GYM_PYTHON), GYM_SIDE, "serve", env, str(port)],
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait(self, timeout_s: float = 120) -> str:
        """"" once it answers, else why it did not."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return _last_line(self.log)
            if _up(self.url + "/docs"):
                return ""
            time.sleep(0.2)
        return f"its server did not answer in {timeout_s:g} s"

    def verdict(self, row: dict, response: dict) -> tuple[float | None, str]:
        """Gym's own verdict on ``response`` for ``row``: seed the session, verify, as
        Gym's agent does; (reward, "") or (None, why not). A server that once took more
        than VERDICT_S is not asked again."""
        if self.slow:
            return None, self.slow
        http = requests.Session()
        try:
            r = http.post(self.url + "/seed_session", json=row, timeout=VERDICT_S)
            if r.ok:
                r = http.post(self.url + "/verify", json={**row, "response": response},
                              timeout=VERDICT_S)
        except requests.Timeout:
            self.slow = f"it gave no verdict in {VERDICT_S:g} s"
            return None, self.slow
        except requests.RequestException as e:
            return None, f"{type(e).__name__}: {e}"[:200]
        finally:
            http.close()
        if not r.ok:
            return None, f"/{r.url.rsplit('/', 1)[-1]} answered {r.status_code}: {r.text[:160]}"
        doc = r.json()
        if doc.get("mask_sample"):
            return None, f"masked: {doc.get('failure_kind')}: {doc.get('failure_reason')}"[:200]
        return float(doc["reward"]), ""

    def stop(self) -> None:
        from tests.farm import stop_process

        stop_process(self.proc)


def message_response(text: str) -> dict:
    """A Responses object of one assistant message: what Gym's simple agent sends
    /verify for a model call that answered ``text``."""
    return {"id": "resp_check", "object": "response", "created_at": time.time(),
            "model": "policy", "output": [{
                "type": "message", "id": "msg_check", "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


def collect(config: Path, rows: list[dict], tmp: Path, name: str, parallel: int = 8,
            agent: str = "prorl_farm_agent") -> tuple[list[dict], list[dict], str]:
    """``ng_collect_rollouts`` over ``rows``: (output rows, failures-file rows, "" or why
    the collection failed)."""
    inp, out = tmp / f"{name}.jsonl", tmp / f"{name}-rollouts.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = subprocess.run([str(GYM_PYTHON.parent / "ng_collect_rollouts"),
                          f"+config_paths=[{config}]", f"+agent_name={agent}",
                          f"+input_jsonl_fpath={inp}", f"+output_jsonl_fpath={out}",
                          f"+num_samples_in_parallel={parallel}"],
                         cwd=tmp, capture_output=True, text=True, timeout=900)
    results = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() \
        else []
    side = tmp / f"{name}-rollouts_failures.jsonl"
    failures = [json.loads(line) for line in side.read_text().splitlines()] \
        if side.exists() else []
    why = "" if run.returncode == 0 else \
        f"ng_collect_rollouts exit {run.returncode}: {(run.stdout + run.stderr)[-300:]}"
    return results, failures, why


def valid(path: Path) -> int:
    """Rows of ``path`` that Gym's ``BaseVerifyResponse`` takes."""
    if not path.exists() or not path.read_text().strip():
        return 0
    run = subprocess.run([str(GYM_PYTHON), GYM_SIDE, "validate", str(path)],
                         capture_output=True, text=True, timeout=300)
    return sum("error" not in json.loads(line) for line in run.stdout.splitlines())


def _match(results: list[dict], cases_: list[Case]) -> list[tuple[Case, dict]]:
    by_key = {key_of(c.row): c for c in cases_}
    return [(by_key[key_of(r)], r) for r in results if key_of(r) in by_key]


@dataclass
class EnvResult:
    env: str
    rows: int = 0
    returned: int = 0  # output rows with a reward (not failure records)
    valid: int = 0  # of them, valid as Gym's BaseVerifyResponse
    right: tuple[int, int] = (0, 0)  # (agree, compared) in the right pass
    wrong: tuple[int, int] = (0, 0)  # ... in the wrong pass
    earned: float | None = None  # mean farm reward of the right pass
    reason: str = ""  # why it cannot run here, or what went wrong
    disagreements: list = field(default_factory=list)

    def line(self) -> str:
        def frac(p):
            return f"{p[0]}/{p[1]}" if p[1] else "-"
        if self.reason and not self.rows:
            return f"| {self.env} | | | | | | | {self.reason} |"
        return (f"| {self.env} | {self.rows} | {self.returned} | {self.valid} | "
                f"{frac(self.right)} | {frac(self.wrong)} | "
                f"{'-' if self.earned is None else f'{self.earned:.2f}'} | "
                f"{self.reason} |")


def post_rows(gym_url: str, rows: list[dict], agent: str) -> tuple[list, list, str]:
    """The rows POSTed to the Gym server's ``/run`` as Gym's collector sends them (eight at
    a time, ``agent_ref`` stamped): (rows with a reward, failure records, "" or what
    failed)."""
    import concurrent.futures

    def one(row: dict) -> dict:
        body = {**row, "agent_ref": {"type": "responses_api_agents", "name": agent}}
        r = requests.post(gym_url + "/run", json=body, timeout=900)
        r.raise_for_status()
        return r.json()

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, rows))
    except requests.RequestException as e:
        return [], [], f"/run: {e}"[:300]
    return ([a for a in answers if "_ng_failure_class" not in a],
            [a for a in answers if "_ng_failure_class" in a], "")


def run_env(env: str, replay: Replay, start_gym, config: Path, tmp: Path, port: int,
            gym_url: str, limit: int = 0, passes: tuple[bool, ...] = (False, True),
            agent: str = "prorl_farm_agent") -> EnvResult:
    """One environment through the farm (``start_gym(resources_server_url)`` starts the
    `prorl-farm gym` at ``gym_url`` the config names as ``agent`` and returns its
    stopper); ``passes``: the right pass (False: through ``ng_collect_rollouts``), the
    wrong one (True: through ``ng_collect_rollouts`` when it is the only one, else posted
    to ``/run`` as the collector posts)."""
    res = EnvResult(env)
    got, why = cases(env, limit)
    if not got:
        res.reason = why
        return res
    if not any(c.turns for c in got):
        passes, res.reason = tuple(p for p in passes if p), why
    server = EnvServer(env, port, tmp / f"{env}-server.log")
    try:
        why = server.wait()
        if why:
            res.reason = why
            return res
        # Gym's own verdicts on the same answers.
        truth_right, truth_wrong = [], []
        for case in got:
            if not case.turns:
                truth_right.append((None, "nothing to replay"))
            elif case.tools:
                truth_right.append((case.recorded, ""))
            else:
                truth_right.append(server.verdict(case.row, case.response))
            truth_wrong.append(server.verdict(case.row, message_response(WRONG)))
        asked = [t for t, c in zip(truth_right, got) if c.turns] + truth_wrong
        blocked = [w for (v, w) in asked if v is None]
        if len(blocked) == len(asked):
            res.reason = f"its /verify gives no verdict here: {_plain(blocked[0])}"
            return res
        replay.cases = got
        stop = start_gym(server.url)
        try:
            rows = [c.row for c in got]
            res.rows = len(rows)
            for wrong in passes:
                replay.wrong = wrong
                name = f"{env}-{'wrong' if wrong else 'right'}"
                if wrong and passes != (True,):  # the second pass: /run itself
                    results, failures, why = post_rows(gym_url, rows, agent)
                else:
                    results, failures, why = collect(config, rows, tmp, name, agent=agent)
                scored = [r for r in results if not r.get("mask_sample")]
                truth = truth_wrong if wrong else truth_right
                agree = compared = 0
                for case, r in _match(scored, got):
                    want = truth[got.index(case)][0]
                    if want is None:
                        continue
                    compared += 1
                    if abs(float(r["reward"]) - want) < 1e-9:
                        agree += 1
                    else:
                        said = [(i["type"], str(i.get("content") or i.get("name"))[:200])
                                for i in r["response"]["output"]]
                        res.disagreements.append((name, key_of(case.row)[-60:],
                                                  r["reward"], want, said))
                if wrong:
                    res.wrong = (agree, compared)
                else:
                    res.right = (agree, compared)
                    res.earned = sum(float(r["reward"]) for r in scored) / max(1, len(scored))
                if wrong and passes != (True,):
                    continue
                # The rows returned, valid, lost: of the first pass.
                res.returned = len(scored)
                res.valid = valid(tmp / f"{name}-rollouts.jsonl")
                lost = failures + [r for r in results if r.get("mask_sample")]
                simulated = any(_plain(str(i.get("output"))) == NO_MODEL_SAYS
                                for r in results for i in r["response"]["output"]
                                if i.get("type") == "function_call_output")
                res.reason = "; ".join(filter(None, [res.reason, *sorted({
                    _plain(str(f.get("failure_reason") or f.get("_ng_failure_message")))[:160]
                    for f in lost}), why if not lost else "",
                    f"its tools: {NO_MODEL_SAYS}" if simulated else ""]))[:400]
            if blocked and not res.reason:
                res.reason = f"Gym's own verdict missing on {len(blocked)} answers: " \
                             f"{_plain(blocked[0])}"
        finally:
            stop()
    finally:
        server.stop()
    return res


def environments() -> list[str]:
    """Every environment of the installed nemo-gym with an example dataset."""
    return sorted(p.parent.parent.name for p in ENVS.glob("*/data/example.jsonl"))


if __name__ == "__main__":
    print("\n".join(environments()), file=sys.stderr)
