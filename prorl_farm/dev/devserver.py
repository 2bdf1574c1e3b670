"""`prorl-farm serve-model`: a CPU development server for any local Hugging Face causal LM.

It speaks the routes the farm uses of vLLM (``POST /v1/completions`` with token-ID prompts,
``GET /v1/models``, ``GET /health``) and of SGLang (``POST /generate``,
``GET /get_model_info``), token IDs in and out, so the whole farm can be developed and
tested without a GPU. Logprobs are raw by default: ``log_softmax`` of the model's logits
before temperature, top-k and top-p (vLLM's default ``raw_logprobs``); sampling applies
them. With ``logprobs_mode="processed_logprobs"`` (``serve-model --logprobs-mode``, as
vLLM's flag) they are those of the distribution sampled from: after temperature, min-p,
top-k and top-p (what a trainer that divides its logits by the temperature computes).
Requests that arrive together are generated together (one padded forward pass per token,
each with its own sampling parameters and seed); a client that disconnects aborts its
generation.
New weights load from local safetensors between requests through either engine's route:
vLLM's ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": ...}}``
(which vLLM serves with ``VLLM_SERVER_DEV_MODE=1``) or SGLang's
``POST /update_weights_from_disk {"model_path": ...}``; ``/reset_prefix_cache`` (vLLM) and
``/flush_cache`` (SGLang) answer as theirs do (this server keeps no prefix cache) and are
counted in ``/get_model_info``, so tests see that a weight sync called them. Prompt logprobs
come as vLLM (``prompt_logprobs``) and SGLang (``logprob_start_len`` with
``input_token_logprobs``) return them: what the farm's weight check reads.

Sampling fields it does not implement (repetition, presence and frequency penalties other
than neutral) are refused with a 400, never ignored: a trainer must not believe it sampled
with settings it did not get.
"""

from __future__ import annotations

import inspect
import json
import logging
import secrets
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from prorl_farm.errors import FarmError

log = logging.getLogger(__name__)


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


class BadRequest(FarmError, ValueError):
    """A request the dev server refuses (400), with the reason."""


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    stop_token: int | None
    prompt_len: int
    # The weights' version label (/update_weight_version) that sampled them: a batch runs
    # under one set of weights (loads happen between batches), so one span per request.
    weight_version: str | None = None


# Requests generated together in one padded batch, at most.
MAX_BATCH = 64


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    stops: set
    gen: object
    aborted: object
    out: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    result: Sampled | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    version: str | None = None

    def finish(self, reason: str, stop_token: int | None = None) -> None:
        self.result = Sampled(self.out, self.logprobs, reason, stop_token, len(self.prompt),
                              self.version)
        self.done.set()


class DevModel:
    """A local causal LM with KV-cache sampling that records raw (or processed) logprobs."""

    def __init__(self, model_dir: str | Path, name: str | None = None, threads: int = 0,
                 max_model_len: int | None = None, logprobs_mode: str = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode!r}: expected one of {LOGPROBS_MODES}")
        self.logprobs_mode = logprobs_mode
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.dir = Path(model_dir)
        self.name = name or self.dir.name
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(self.dir), dtype=torch.float32)
        self.model.eval()
        cfg = self.model.config
        self.max_len = int(max_model_len or getattr(cfg, "max_position_embeddings", 4096))
        self.vocab_size = int(cfg.vocab_size)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        # transformers 5 takes the KV cache as `cache`; 4.x as `past_key_values`.
        self._cache_kw = ("cache" if "cache" in inspect.signature(self.model.forward).parameters
                          else "past_key_values")
        # ``lock``: one forward pass at a time (a step of a batch, a prompt's logprobs);
        # ``batch_lock``: a whole batch, which a weight load waits for (no generation sees
        # two sets of weights) while prompt logprobs go between its steps.
        self.lock = threading.Lock()
        self.batch_lock = threading.Lock()
        self.weights_path = str(self.dir)
        self.weight_loads = 0
        self.cache_resets = 0  # /reset_prefix_cache and /flush_cache calls
        self._pending: list[_Request] = []
        self._pending_cv = threading.Condition()
        # vLLM's RL routes: /pause (abort | wait), /resume, /update_weight_version.
        self.weight_version: str | None = None
        self.paused = False
        self._abort_running = False  # set by a pause in "abort" mode until the batch ends
        self._running = False  # a batch is being generated
        self.running = 0  # requests in that batch
        threading.Thread(target=self._scheduler, name="dev-model-batches", daemon=True).start()

    def _forward(self, ids, cache, mask, pos):
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
                  "use_cache": True}
        if cache is not None:
            kwargs[self._cache_kw] = cache
        with self.lock:
            out = self.model(**kwargs)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = out.past_key_values
        return out.logits[:, -1].float(), new_cache

    def _pick(self, logits, temperature: float, top_p: float, top_k: int, min_p: float,
              gen) -> tuple[int, float | None]:
        """The sampled token, and its logprob under the distribution sampled from where the
        server returns processed logprobs (else None, as for greedy: no distribution; the
        raw logprob stands)."""
        torch = self.torch
        if temperature <= 0:
            return int(torch.argmax(logits)), None
        scaled = logits / temperature
        if min_p > 0:  # drop tokens less likely than min_p times the likeliest
            probs = torch.softmax(scaled, -1)
            scaled = scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))
        if 0 < top_k < scaled.numel():
            kth = torch.topk(scaled, top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if 0 < top_p < 1:
            sorted_logits, order = torch.sort(scaled, descending=True)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, -1) > top_p  # keep the first over top_p
            scaled = scaled.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scaled, -1)
        token = int(torch.multinomial(probs, 1, generator=gen))
        if self.logprobs_mode != "processed_logprobs":
            return token, None
        return token, float(torch.log_softmax(scaled, -1)[token])

    def sample(self, prompt: list[int], max_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
               seed: int | None = None,
               stop_token_ids: list[int] | None = None, ignore_eos: bool = False,
               aborted=lambda: False) -> Sampled:
        """Sample one completion. Requests that wait together are generated together, one
        padded forward pass per token for all of them, each with its own sampling
        parameters and seeded generator; a request returns as soon as it ends."""
        torch = self.torch
        self._check_prompt(prompt, max_tokens)
        req = _Request(prompt=list(prompt), max_tokens=max_tokens, temperature=temperature,
                       top_p=top_p, top_k=top_k, min_p=min_p,
                       stops=set(stop_token_ids or []) | (set() if ignore_eos
                                                           else self.eos_ids),
                       gen=torch.Generator().manual_seed(
                           seed if seed is not None else secrets.randbits(63)),
                       aborted=aborted)
        if max_tokens == 1:  # one forward pass: served between the steps of a batch
            return self._sample_one(req)
        with self._pending_cv:
            self._pending.append(req)
            self._pending_cv.notify()
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.result

    def _sample_one(self, req: _Request) -> Sampled:
        """A one-token request (a weight check's probe, a prompt's logprobs) at once, not
        behind the batch being generated, as a continuously batching engine serves it; a
        paused engine holds it like any other."""
        torch = self.torch
        self._wait_unpaused()
        with self.lock, torch.no_grad():
            req.version = self.weight_version
            logits = self.model(input_ids=torch.tensor([req.prompt])).logits[0, -1].float()
            token, processed = self._pick(logits, req.temperature, req.top_p, req.top_k,
                                          req.min_p, req.gen)
        req.out.append(token)
        req.logprobs.append(processed if processed is not None
                            else float(torch.log_softmax(logits, -1)[token]))
        if token in req.stops:
            req.finish("stop", token)
        else:
            req.finish("length")
        return req.result

    def _scheduler(self) -> None:
        while True:
            with self._pending_cv:
                while not self._pending or self.paused:
                    self._pending_cv.wait()
                batch = self._pending[:MAX_BATCH]
                del self._pending[:MAX_BATCH]
                self._running, self.running = True, len(batch)
            with self.batch_lock:  # weight loads happen between batches
                try:
                    for r in batch:
                        r.version = self.weight_version
                    self._generate_batch(batch)
                except Exception as e:  # noqa: BLE001 - every waiter must hear of it
                    log.exception("generation failed")
                    for r in batch:
                        if not r.done.is_set():
                            r.error = e
                            r.done.set()
            with self._pending_cv:
                self._running, self.running = False, 0
                self._pending_cv.notify_all()

    def pause(self, mode: str = "abort") -> None:
        """vLLM's ``/pause``: no new batch starts until :meth:`resume`. ``abort``: the batch
        being generated ends now (each request ``abort``, with the tokens it has) and the
        requests waiting end ``abort`` with none; ``wait``: the batch runs to its end, the
        waiting ones stay queued. Returns once no batch runs. (``keep``, which freezes
        requests mid-generation on their old KV cache, is not offered.)"""
        if mode not in ("abort", "wait"):
            raise BadRequest(f"mode: abort or wait (this server does not offer {mode!r})")
        with self._pending_cv:
            self.paused = True
            if mode == "abort":
                self._abort_running = True
                waiting, self._pending = self._pending, []
                for r in waiting:
                    r.version = self.weight_version
                    r.finish("abort")
            while self._running:
                self._pending_cv.wait()
            self._abort_running = False

    def resume(self) -> None:
        with self._pending_cv:
            self.paused = False
            self._pending_cv.notify_all()

    def _wait_unpaused(self) -> None:
        with self._pending_cv:
            while self.paused:
                self._pending_cv.wait()

    def _generate_batch(self, batch: list[_Request]) -> None:
        torch = self.torch
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)  # left-padded
            mask[i, width - len(r.prompt):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        live = list(range(len(batch)))
        with torch.no_grad():
            logits, cache = self._forward(ids, None, mask, pos)
            step = 0
            while live:
                raw = torch.log_softmax(logits, -1)
                nxt = torch.zeros(len(batch), dtype=torch.long)
                for i in list(live):
                    r = batch[i]
                    token, processed = self._pick(logits[i], r.temperature, r.top_p,
                                                  r.top_k, r.min_p, r.gen)
                    r.out.append(token)
                    r.logprobs.append(processed if processed is not None
                                      else float(raw[i, token]))
                    nxt[i] = token
                    if token in r.stops:
                        r.finish("stop", token)
                    elif len(r.out) >= r.max_tokens:
                        r.finish("length")
                    elif self._abort_running or (step % 8 == 7 and r.aborted()):
                        r.finish("abort")
                    if r.done.is_set():
                        live.remove(i)
                if not live:
                    break
                alive = torch.zeros((len(batch), 1), dtype=torch.long)
                alive[live] = 1
                mask = torch.cat([mask, alive], 1)
                pos = pos[:, -1:] + 1
                logits, cache = self._forward(nxt.unsqueeze(1), cache, mask, pos)
                step += 1

    def prompt_logprobs(self, prompt: list[int]) -> list[float | None]:
        """Each prompt token's raw logprob given the tokens before it (None for the first):
        one forward pass (between the steps of a batch being generated)."""
        torch = self.torch
        self._check_prompt(prompt, 0)
        self._wait_unpaused()  # as vLLM's: a paused engine schedules nothing
        with self.lock, torch.no_grad():
            logits = self.model(input_ids=torch.tensor([prompt])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        return [None] + [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]

    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        if not prompt:
            raise BadRequest("prompt must not be empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt):
            raise BadRequest(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(prompt) + max_tokens > self.max_len:
            raise BadRequest(f"This model's maximum context length is {self.max_len} tokens; "
                             f"the prompt has {len(prompt)} and max_tokens is {max_tokens}")

    def load_weights(self, path: str) -> dict:
        """Load new weights into the served model: safetensors, a file or a directory of
        ``*.safetensors`` (what ``save_pretrained`` writes). Everything is read and checked
        (names, shapes) first, then copied in between batches: a request that comes
        meanwhile waits, and no request ever sees a half-loaded model."""
        from safetensors.torch import load_file

        p = Path(path)
        files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) if p.is_dir() else []
        if not files:
            raise BadRequest(f"model_path: no .safetensors file at {path}")
        state: dict = {}
        for f in files:
            state.update(load_file(str(f)))
        own = self.model.state_dict()
        # Tied weights (embeddings = output layer) are saved once: a key may be missing if
        # it shares its storage with one that is present.
        by_ptr: dict[int, set[str]] = {}
        for k, v in own.items():
            by_ptr.setdefault(v.data_ptr(), set()).add(k)
        missing = {k for k in set(own) - set(state)
                   if not (by_ptr[own[k].data_ptr()] & set(state))}
        unknown = set(state) - set(own)
        shapes = [k for k in set(state) & set(own) if tuple(state[k].shape) != tuple(own[k].shape)]
        if missing or unknown or shapes:
            raise BadRequest(f"model_path: weights do not fit this model (missing "
                             f"{sorted(missing)[:5]}, unknown {sorted(unknown)[:5]}, shape "
                             f"mismatch {sorted(shapes)[:5]})")
        with self.batch_lock, self.lock, self.torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v.to(own[k].dtype))
            self.weights_path = str(p)
            self.weight_loads += 1
        return {"success": True, "message": f"loaded {len(state)} tensors from {p}",
                "weight_loads": self.weight_loads}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              for t in value):
        raise BadRequest(f"{name} must be a list of token ids")
    return value


# Sampling fields this server accepts only at their neutral value (it does not implement them).
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _sampling(body: dict, max_tokens_name: str, default_max: int) -> dict:
    """The sample() arguments a request's sampling fields give (vLLM and SGLang agree on
    the names but for the token budget and the seed)."""
    for name, neutral in NEUTRAL.items():
        if _number(body, name, neutral) != neutral:
            raise BadRequest(f"{name}: this development server samples without it; send "
                             f"{neutral} (or serve the model with vLLM)")
    return dict(max_tokens=int(_number(body, max_tokens_name, default_max, int)),
                temperature=_number(body, "temperature", 1.0),
                top_p=_number(body, "top_p", 1.0), top_k=int(_number(body, "top_k", -1, int)),
                min_p=_number(body, "min_p", 0.0),
                stop_token_ids=body.get("stop_token_ids"),
                ignore_eos=bool(body.get("ignore_eos")))


def _number(body: dict, name: str, default, cast=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number")
    return cast(value)


def send_body(handler: BaseHTTPRequestHandler, status: int, data: bytes,
              content_type: str = "application/json") -> None:
    """A whole response with its length (the connection stays open for the next request)."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class DevHandler(BaseHTTPRequestHandler):
    server_version = "prorl-dev-model/1"
    protocol_version = "HTTP/1.1"
    model: DevModel  # set on the subclass made by make_server

    def log_message(self, fmt, *args):  # route through logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    def setup(self):
        super().setup()
        # Headers and body leave in two writes: without this, Nagle holds the body of a
        # kept-alive connection's answer until the client's delayed ACK (40 ms).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -- plumbing -------------------------------------------------------------------------

    def _send(self, status: int, body: dict) -> None:
        send_body(self, status, json.dumps(body).encode())

    def _error(self, status: int, message: str) -> None:
        kind = "BadRequestError" if status == 400 else "NotFoundError"
        self._send(status, {"object": "error", "message": message, "type": kind,
                            "code": status, "error": {"message": message}})

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as e:
            raise BadRequest(f"invalid JSON: {e}") from e
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    def _client_gone(self) -> bool:
        """True once the client closed its connection (it gave up on this request)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def do_GET(self):
        m = self.model
        if self.path == "/health":
            self._send(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{
                "id": m.name, "object": "model", "owned_by": "prorl-farm",
                "max_model_len": m.max_len, "root": str(m.dir)}]})
        elif self.path == "/get_model_info":
            self._send(200, {"model_path": str(m.dir), "tokenizer_path": str(m.dir),
                             "is_generation": True, "weights_path": m.weights_path,
                             "weight_loads": m.weight_loads, "cache_resets": m.cache_resets,
                             "max_model_len": m.max_len, "running": m.running,
                             "waiting": len(m._pending)})
        elif self.path == "/flush_cache":
            self._flush()
        elif self.path == "/is_paused":
            self._send(200, {"is_paused": m.paused})
        elif self.path == "/weight_info":
            self._send(200, {"weight_version": m.weight_version})
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self):
        try:
            body = self._body()
            if self.path == "/v1/completions":
                self._send(200, self._completions(body))
            elif self.path == "/generate":
                self._send(200, self._generate(body))
            elif self.path == "/update_weights_from_disk":
                # SGLang's route and body: {"model_path": ...}.
                path = body.get("model_path")
                if not isinstance(path, str) or not path:
                    raise BadRequest("model_path: a local path is required")
                self._send(200, self.model.load_weights(path))
            elif self.path == "/collective_rpc":
                self._collective_rpc(body)
            elif self.path.split("?")[0] == "/reset_prefix_cache":
                self.model.cache_resets += 1
                self._send(200, {"success": True})
            elif self.path == "/flush_cache":
                self._flush()
            elif self.path == "/inference/v1/generate":
                self._send(200, self._generate_tokens(body))
            elif self.path.split("?")[0] == "/pause":
                query = parse_qs(urlsplit(self.path).query)
                self.model.pause(query.get("mode", ["abort"])[0])
                self._send(200, {"status": "paused"})
            elif self.path == "/resume":
                self.model.resume()
                self._send(200, {"status": "resumed"})
            elif self.path == "/update_weight_version":
                version = body.get("new_version")
                if not isinstance(version, str) or not version:
                    raise BadRequest("new_version: a non-empty string is required")
                self.model.weight_version = version
                self._send(200, {"success": True, "new_version": version})
            else:
                self._error(404, f"no route {self.path}")
        except BadRequest as e:
            self._error(400, str(e))
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away")

    def _flush(self) -> None:
        """SGLang's /flush_cache: 200 with a plain-text message."""
        self.model.cache_resets += 1
        send_body(self, 200, b"Cache flushed.\n", "text/plain")

    # -- vLLM -----------------------------------------------------------------------------

    def _collective_rpc(self, body: dict) -> None:
        """vLLM's /collective_rpc for the one method a weight sync calls: reload_weights
        (kwargs weights_path; answers as vLLM does: one result per worker)."""
        if body.get("method") != "reload_weights":
            raise BadRequest(f"method: this server offers reload_weights only, not "
                             f"{body.get('method')!r}")
        kwargs = body.get("kwargs") or {}
        path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
        if not isinstance(path, str) or not path:
            raise BadRequest("kwargs.weights_path: a local path is required")
        self.model.load_weights(path)
        self._send(200, {"results": [None]})

    def _completions(self, body: dict) -> dict:
        m = self.model
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [m.tokenizer.encode(prompt, add_special_tokens=False)]
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompts = [_int_list(p, "prompt") for p in prompt]
        else:
            prompts = [_int_list(prompt, "prompt")]
        if body.get("n", 1) != 1:
            raise BadRequest("this development server supports n=1 only")
        want_logprobs = body.get("logprobs") is not None
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        skip = body.get("skip_special_tokens", True)
        choices, usage_p, usage_c = [], 0, 0
        sampling = _sampling(body, "max_tokens", 16)
        for index, p in enumerate(prompts):
            s = m.sample(p, **sampling, seed=body.get("seed"), aborted=self._client_gone)
            choice = {"index": index, "text": m.decode(s.token_ids, skip),
                      "finish_reason": s.finish_reason, "stop_reason": s.stop_token,
                      "logprobs": None}
            if want_logprobs:
                tokens = ([f"token_id:{t}" for t in s.token_ids] if as_ids
                          else m.tokenizer.convert_ids_to_tokens(s.token_ids))
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": s.logprobs,
                                      "top_logprobs": None, "text_offset": []}
            if body.get("return_token_ids"):
                choice["token_ids"] = s.token_ids
                choice["prompt_token_ids"] = p
            if body.get("prompt_logprobs") is not None:
                # vLLM's shape: None, then {str(token id): {logprob, rank, decoded_token}}.
                choice["prompt_logprobs"] = [None] + [
                    {str(t): {"logprob": lp, "rank": None, "decoded_token": f"token_id:{t}"}}
                    for t, lp in zip(p[1:], m.prompt_logprobs(p)[1:])]
            choices.append(choice)
            usage_p, usage_c = usage_p + len(p), usage_c + len(s.token_ids)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": m.name, "choices": choices,
                "usage": {"prompt_tokens": usage_p, "completion_tokens": usage_c,
                          "total_tokens": usage_p + usage_c}}

    def _generate_tokens(self, body: dict) -> dict:
        """vLLM's token-in/token-out ``/inference/v1/generate`` (tokens output mode): token
        ids, their logprobs and the weight version spans that sampled them."""
        m = self.model
        prompt = _int_list(body.get("token_ids"), "token_ids")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        if body.get("stream"):
            raise BadRequest("stream: this development server answers whole responses only")
        s = m.sample(prompt, **_sampling(sp, "max_tokens", 16), seed=sp.get("seed"),
                     aborted=self._client_gone)
        choice = {"index": 0, "finish_reason": s.finish_reason, "stop_reason": s.stop_token,
                  "token_ids": s.token_ids, "logprobs": None,
                  "weight_versions": [{"version": s.weight_version, "start": 0,
                                       "end": len(s.token_ids)}] if s.token_ids else []}
        if sp.get("logprobs") is not None:
            choice["logprobs"] = {"content": [{"token_id": t, "logprob": lp, "rank": None,
                                               "top_logprobs": []}
                                              for t, lp in zip(s.token_ids, s.logprobs)]}
        return {"request_id": body.get("request_id") or uuid.uuid4().hex, "model": m.name,
                "created": int(time.time()), "output_mode": "tokens", "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(s.token_ids),
                          "total_tokens": len(prompt) + len(s.token_ids)}}

    # -- SGLang ---------------------------------------------------------------------------

    def _generate(self, body: dict) -> dict:
        m = self.model
        if "input_ids" in body:
            prompt = _int_list(body["input_ids"], "input_ids")
        elif isinstance(body.get("text"), str):
            prompt = m.tokenizer.encode(body["text"], add_special_tokens=False)
        else:
            raise BadRequest("give input_ids (a list of token ids) or text")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        s = m.sample(prompt, **_sampling(sp, "max_new_tokens", 128),
                     seed=sp.get("sampling_seed", sp.get("seed")), aborted=self._client_gone)
        if s.finish_reason == "stop":
            finish = {"type": "stop", "matched": s.stop_token}
        elif s.finish_reason == "length":
            finish = {"type": "length", "length": len(s.token_ids)}
        else:
            finish = {"type": "abort", "message": "client disconnected"}
        meta = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(prompt),
                "completion_tokens": len(s.token_ids)}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None]
                                             for lp, t in zip(s.logprobs, s.token_ids)]
            start = body.get("logprob_start_len", -1)
            if isinstance(start, int) and 0 <= start < len(prompt):
                # SGLang's shape: [logprob, token id, text] from prompt position start.
                lps = m.prompt_logprobs(prompt)
                meta["input_token_logprobs"] = [[lps[i], prompt[i], None]
                                                for i in range(start, len(prompt))]
        return {"text": m.decode(s.token_ids, sp.get("skip_special_tokens", True)),
                "output_ids": s.token_ids, "meta_info": meta}


class ModelHTTPServer(ThreadingHTTPServer):
    """An inference server's HTTP side: a listen backlog like real servers' (farms open many
    connections at once), a thread per connection, and a client that went away mid-answer
    (a cancelled job) taken as the everyday thing it is, not printed as a traceback."""

    request_queue_size = 1024
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def make_server(model: DevModel, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    handler = type("BoundDevHandler", (DevHandler,), {"model": model})
    return ModelHTTPServer((host, port), handler)


def serve(model_dir: str, host: str, port: int, name: str | None = None,
          max_model_len: int | None = None, logprobs_mode: str = "raw_logprobs") -> None:
    model = DevModel(model_dir, name, max_model_len=max_model_len, logprobs_mode=logprobs_mode)
    server = make_server(model, host, port)
    log.info("serving %s on http://%s:%d (vLLM and SGLang routes)", model.name, host,
             server.server_address[1])
    print(f"dev model {model.name} on http://{host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
