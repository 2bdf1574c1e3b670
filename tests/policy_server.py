"""A scripted policy server: the test double for a GPU LLM server.

It speaks the same routes as vLLM (/inference/v1/generate, /v1/completions) and SGLang
(/generate), token IDs in and out, and answers with a deterministic function of the
prompt. It records which job (X-Prorl-Job) each request came from, can be slowed down,
made to fail, or killed.

With a ``planner`` it plays a planned episode instead: ``planner(prompt_ids)`` returns the
token IDs of the next turn and its finish reason (see :func:`text_planner`, which picks the
planned text of a case named in the prompt and tokenises it with the test tokenizer).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler

from prorl_farm.dev.devserver import ModelHTTPServer, send_body


def scripted_tokens(prompt: list[int], n: int) -> list[int]:
    return [10 + (len(prompt) + i) % 50 for i in range(n)]


def tool_call(name: str, **arguments) -> str:
    """A hermes-format tool call, as a policy writes it."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + \
        "\n</tool_call>"


def text_planner(tokenizer_path: str, plans: dict[str, list[str]], marker: str = "[case:",
                 end_token: str = "<|im_end|>"):
    """A planner for ChatML prompts: the case is named in the prompt as ``[case:NAME]``; the
    turn is the number of assistant turns already in the prompt; the answer is that turn's
    planned text tokenised by the test tokenizer, then the end-of-turn token. Past the last
    planned turn it repeats the last one."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    end_id = tok.convert_tokens_to_ids(end_token)
    lock = threading.Lock()

    def plan(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        with lock:
            text = tok.decode(prompt, skip_special_tokens=False)
        at = text.find(marker)
        case = text[at + len(marker):text.index("]", at)] if at >= 0 else ""
        turns = plans.get(case) or ["(no plan)"]
        turn = max(0, text.count("<|im_start|>assistant") - 1)
        with lock:
            ids = list(tok.encode(turns[min(turn, len(turns) - 1)], add_special_tokens=False))
        ids.append(end_id)
        if len(ids) > max_tokens:
            return ids[:max_tokens], "length"
        return ids, "stop"

    return plan


class PolicyServer:
    def __init__(self, delay_s: float = 0.0, port: int = 0, planner=None):
        self.delay_s = delay_s
        self.planner = planner
        self.prompts: dict[str, list[list[int]]] = defaultdict(list)  # job -> prompts
        self.fail = False  # answer 500
        self.requests: list[tuple[str, int]] = []  # (job, prompt length)
        self.posts: list[str] = []  # the path of every POST, in order (any route)
        self.in_flight = 0
        self.dead = False
        self.connections: set = set()  # open client sockets (kept alive between requests)
        self.accepted = 0  # connections accepted, ever
        self._lock = threading.Lock()
        self._port = port
        self.start()

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"owner": self})
        self.httpd = ModelHTTPServer(("127.0.0.1", self._port), handler)
        self._port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def kill(self) -> None:
        """Stop answering at once, as a dead process would: open connections are cut and
        new ones refused."""
        self.dead = True
        self.httpd.shutdown()
        self.httpd.server_close()
        self.drop_connections()

    def drop_connections(self) -> None:
        """Close every open connection (as a server does with idle kept-alive ones)."""
        with self._lock:
            for sock in list(self.connections):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def jobs(self) -> dict[str, int]:
        with self._lock:
            return dict(Counter(job for job, _ in self.requests))

    def record(self, job: str, prompt_len: int, prompt: list[int] | None = None) -> None:
        with self._lock:
            self.requests.append((job, prompt_len))
            if prompt is not None and self.planner is not None:
                self.prompts[job].append(list(prompt))
            self.in_flight += 1

    def done(self) -> None:
        with self._lock:
            self.in_flight -= 1


class _Handler(BaseHTTPRequestHandler):
    owner: PolicyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as uvicorn
        with self.owner._lock:
            self.owner.connections.add(self.connection)
            self.owner.accepted += 1

    def finish(self):
        with self.owner._lock:
            self.owner.connections.discard(self.connection)
        super().finish()

    def handle_one_request(self):
        if self.owner.dead:
            self.close_connection = True
            return
        super().handle_one_request()

    def _send(self, status: int, body: dict) -> None:
        send_body(self, status, json.dumps(body).encode())

    def do_GET(self):
        if self.path == "/health" and not self.owner.fail:
            self._send(200, {"ok": True})
        elif self.path == "/v1/models" and not self.owner.fail:  # as vLLM lists its model
            self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
        else:
            self._send(503 if self.path == "/health" else 404, {"error": "no"})

    def do_POST(self):
        owner = self.owner
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with owner._lock:
            owner.posts.append(self.path)
        if self.path not in ("/inference/v1/generate", "/v1/completions", "/generate"):
            self._send(404, {"error": f"no route {self.path}"})
            return
        prompt = body.get("prompt") or body.get("input_ids") or body.get("token_ids")
        owner.record(self.headers.get("X-Prorl-Job", ""), len(prompt), prompt)
        try:
            if owner.fail:
                self._send(500, {"error": "scripted failure"})
                return
            end = time.monotonic() + owner.delay_s
            while time.monotonic() < end:
                time.sleep(min(0.05, max(0.0, end - time.monotonic())))
            if self.path == "/inference/v1/generate":  # vLLM's token route
                wanted = body["sampling_params"].get("max_tokens", 16)
                finish = "length"
                if owner.planner is not None:
                    ids, finish = owner.planner(prompt, wanted)
                else:
                    ids = scripted_tokens(prompt, wanted)
                self._send(200, {"choices": [{
                    "index": 0, "token_ids": ids, "finish_reason": finish,
                    "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in ids]},
                    "weight_versions": [{"version": None, "start": 0, "end": len(ids)}]}]})
            elif self.path == "/v1/completions":
                finish = "length"
                if owner.planner is not None:
                    ids, finish = owner.planner(prompt, body.get("max_tokens", 16))
                else:
                    ids = scripted_tokens(prompt, body.get("max_tokens", 16))
                self._send(200, {"choices": [{
                    "index": 0, "text": "", "token_ids": ids, "finish_reason": finish,
                    "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                 "token_logprobs": [-0.5] * len(ids)}}]})
            else:
                ids = scripted_tokens(prompt, body["sampling_params"].get("max_new_tokens", 16))
                self._send(200, {"text": "", "output_ids": ids, "meta_info": {
                    "finish_reason": {"type": "length"},
                    "output_token_logprobs": [[-0.5, t, None] for t in ids]}})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up on the request (cancelled job)
        finally:
            owner.done()


def per_job_servers(servers: dict[str, PolicyServer]) -> dict[str, set[str]]:
    """job -> names of the servers that saw its requests."""
    out: dict[str, set[str]] = defaultdict(set)
    for name, server in servers.items():
        for job in server.jobs():
            out[job].add(name)
    return out
