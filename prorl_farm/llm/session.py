"""A job's sticky connection to the LLM backends: every turn to the backend the job is
pinned to, fail-over once to another if that backend fails, never hang.

A turn costs one Redis round trip (the pin, with the backend's request fields and the
latencies to record folded in) and none while the last pin is younger than ``PIN_TTL_S``:
fast turns (a quick tool loop) skip it, so an unregistered backend is noticed within that
time; a drained one keeps the jobs pinned to it anyway. Requests reuse one kept-alive
connection per backend, taken from (and given back to) the worker process's idle ones."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prorl_farm.context import JobContext
from prorl_farm.errors import BackendError, BackendUnavailable, InvalidInstance, NotFound
from prorl_farm.llm.backends import Generation, client_for
from prorl_farm.llm.registry import Backend, BackendRegistry

log = logging.getLogger(__name__)

PIN_TTL_S = 0.25
# Backends a job may move past before its first turn (their tokenizer did not load).
MAX_SETUP_MOVES = 8
T = TypeVar("T")
# Interruptions of one turn (weight updates in place) after which it fails.
MAX_INTERRUPTIONS = 16
# How long a turn sampled by weights loaded in place waits for the farm's check of them
# (one probe request, after the engine resumed) before its tokens are given up.
CHECK_WAIT_S = 120.0


def _joined(parts: list[Turn]) -> Turn:
    """One turn from the parts of an interrupted one: their tokens and logprobs end to end,
    each part's versions at its offset, the last part's finish and backend."""
    ids, lps, versions, latency = [], [], [], 0.0
    for p in parts:
        if not p.generation.token_ids:
            continue  # interrupted before its first token
        for i, v in p.versions:
            if not versions or versions[-1][1] != v:
                versions.append((len(ids) + i, v))
        ids += p.generation.token_ids
        lps += p.generation.logprobs
        latency += p.generation.latency_ms
    last = parts[-1].generation
    meta = dict(last.raw_meta, interruptions=len(parts) - 1)
    return Turn(Generation(ids, lps, last.finish_reason, latency, meta, versions),
                parts[-1].backend)


def turn_seed(ctx: JobContext, turn: int) -> int | None:
    """A distinct, reproducible seed per (instance, sample, turn) from the request's seed, so
    the n samples of a group differ while a rerun of the batch repeats them."""
    seed = ctx.sampling.get("seed")
    if seed is None:
        return None
    mixed = (seed * 1_000_003 + ctx.instance_index * 10_007 + ctx.sample_index * 101 + turn)
    return mixed % (2**31 - 1)


@dataclass
class Turn:
    """One generation and where it came from."""

    generation: Generation
    backend: Backend

    @property
    def versions(self) -> list[tuple[int, int]]:
        """(first token, policy version) at each change: the engine's own labels where it
        gives them, else the version the backend was registered at when pinned."""
        return self.generation.versions or [(0, self.backend.policy_version)]


class BackendSession:
    @classmethod
    def for_job(cls, ctx: JobContext) -> BackendSession:
        """The job's session under the farm's settings (fail-overs, request timeout,
        retries), on the job's backend registry."""
        s = ctx.settings
        return cls(ctx.backends, ctx, max_failovers=s.llm_max_failovers,
                   request_timeout_s=s.llm_request_timeout_s, retries=s.llm_retries)

    def __init__(self, registry: BackendRegistry, ctx: JobContext, max_failovers: int = 1,
                 request_timeout_s: float = 600.0, retries: int = 2):
        self.registry = registry
        self.ctx = ctx
        self.max_failovers = max_failovers
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.failovers = 0
        self._exclude = ""
        self._last_failure = ""  # the last backend failure, for the job's failure message
        # The tokenizer of the first backend the job got: a fail-over to a backend with
        # another one would mix token vocabularies in one trajectory.
        self.tokenizer: str | None = None
        # Latencies not yet recorded: backend, sum of ms, requests (with the next pin).
        self._lat: list = ["", 0.0, 0, 0]  # backend, total ms, requests, summed load
        self._pinned: Backend | None = None
        self._pinned_at = 0.0
        # One client (one kept-alive connection) per backend the job talks to.
        self._client = None
        self._client_for: tuple = ()

    def backend(self) -> Backend:
        """The backend this job is pinned to (pinning it now if it is not yet): one Redis
        round trip, which also records the previous request's latency."""
        if self._pinned is not None and time.monotonic() - self._pinned_at < PIN_TTL_S:
            return self._pinned
        backend = self.registry.pin(self.ctx.job_id, self._exclude, self._take_latency())
        if backend is None:
            backend = self._wait_for_resume()
        self._pinned, self._pinned_at = backend, time.monotonic()
        if self.tokenizer is None:
            self.tokenizer = backend.tokenizer
        elif backend.tokenizer != self.tokenizer:
            raise BackendUnavailable(f"fail-over backend {backend.id} uses another "
                                     f"tokenizer ({backend.tokenizer})")
        return backend

    def first_backend(self, load: Callable[[str], T]) -> tuple[Backend, T]:
        """The job's backend and its tokenizer, loaded by ``load`` (from the backend's
        tokenizer path). A backend whose tokenizer does not load (its directory deleted or
        broken since it was registered) leaves the heap and the job moves to another: no
        fail-over is counted, nothing was sampled yet."""
        for _ in range(MAX_SETUP_MOVES):
            backend = self.backend()
            try:
                return backend, load(backend.tokenizer)
            except Exception as e:  # noqa: BLE001 - whatever the load raised, not the job's
                self.ctx.check()
                self.tokenizer = None
                self._fail_over(backend.id, f"tokenizer {backend.tokenizer} does not load: "
                                f"{type(e).__name__}: {e}"[:500], mark=True, counted=False)
        raise BackendUnavailable(f"no backend's tokenizer loaded in {MAX_SETUP_MOVES} tries: "
                                 f"{self._last_failure}")

    def context_limit(self, requested: int) -> int:
        """The context a turn may fill: ``requested`` (the job's), or the pinned engine's
        ``max_model_len`` where that is smaller."""
        served = self.backend().max_model_len
        return min(requested, served) if served else requested

    def room(self, requested: int, context_len: int, first_turn: bool) -> int:
        """Tokens the next turn may generate (0: the episode ends ``context``). A prompt
        that leaves no room at all is the instance's fault, not the policy's: the job
        fails ``invalid_instance`` rather than earning a reward it had no chance at."""
        limit = self.context_limit(requested)
        if first_turn and context_len >= limit:
            raise InvalidInstance(f"the prompt is {context_len} tokens and the context is "
                                  f"{limit} (the request's or the engine's max_model_len): "
                                  "nothing can be generated")
        return max(0, limit - context_len)

    def _wait_for_resume(self) -> Backend:
        """No backend to pin. While a healthy one is drained (a trainer syncing weights:
        it resumes soon), wait for it, up to ``llm_drain_wait_s`` and the job's deadline,
        waking at once on cancellation; otherwise fail now."""
        wait_s = getattr(self.ctx.settings, "llm_drain_wait_s", 0.0) if self.ctx.settings \
            else 0.0
        end = time.monotonic() + wait_s
        pause = 0.02
        while True:
            # A backend kept out by a failed weight check is not about to resume.
            backends = self.registry.list()
            drained = [b["id"] for b in backends
                       if b["drained"] and b["healthy"] and b["id"] != self._exclude
                       and not b["weights"]["error"]
                       and (self.tokenizer is None or b["tokenizer"] == self.tokenizer)]
            if not drained:
                # Resumed since the pin failed (or there is none at all): one more pin says.
                backend = self.registry.pin(self.ctx.job_id, self._exclude)
                if backend is not None:
                    return backend
                out = [f"{b['id']}: {b['weights']['error'] or b['last_error']}"
                       for b in backends if b["weights"]["error"] or not b["healthy"]]
                why = "; ".join(([self._last_failure] if self._last_failure else []) + out)
                raise BackendUnavailable("no healthy, undrained LLM backend is registered"
                                         + (f" ({why})"[:1000] if why else ""))
            if time.monotonic() >= end:
                raise BackendUnavailable(f"every backend stayed drained for {wait_s:g} s "
                                         f"(PRORL_LLM_DRAIN_WAIT_S): {', '.join(drained)}")
            self.ctx.sleep(min(pause, max(0.0, end - time.monotonic())))
            pause = min(pause * 2, 0.5)
            backend = self.registry.pin(self.ctx.job_id, self._exclude)
            if backend is not None:
                return backend

    def _client_of(self, backend: Backend):
        key = (backend.id, backend.kind, backend.url, backend.model)
        if key != self._client_for:
            self.close_client()
            self._client = client_for(backend.kind, backend.url, backend.model,
                                      retries=self.retries,
                                      headers={"X-Prorl-Job": self.ctx.job_id})
            self._client_for = key
        self._client.timeout_s = min(self.request_timeout_s, max(1.0, self.ctx.remaining_s))
        return self._client

    def generate(self, prompt_ids: list[int], sampling: dict) -> Turn:
        """One turn. A generation the engine interrupted (``abort``: a weight update in
        place paused it) goes on from where it stopped: the prompt and the tokens sampled
        so far are sent again, for what is left of the turn's budget, and the parts join
        into one generation whose ``versions`` say which weights sampled which tokens. No
        token is lost or sampled twice."""
        parts: list[Turn] = []
        budget = int(sampling.get("max_tokens") or 0)
        while True:
            done = sum(len(p.generation.token_ids) for p in parts)
            ask = dict(sampling, max_tokens=budget - done) if budget else sampling
            turn = self._generate(prompt_ids + [t for p in parts
                                                for t in p.generation.token_ids], ask)
            parts.append(turn)
            g = turn.generation
            if g.finish_reason != "abort":
                break
            self.ctx.check()  # our own cancellation or deadline: not an update
            if budget and done + len(g.token_ids) >= budget:
                g.finish_reason = "length"
                break
            if len(parts) > MAX_INTERRUPTIONS:
                raise BackendError(f"a turn was interrupted {len(parts)} times by the "
                                   "engine (weight updates in place); giving up")
            log.info("job %s: turn interrupted after %d tokens (a weight update in place); "
                     "going on", self.ctx.job_id, done + len(g.token_ids))
        return parts[0] if len(parts) == 1 else _joined(parts)

    def _generate(self, prompt_ids: list[int], sampling: dict) -> Turn:
        while True:
            self.ctx.check()
            backend = self.backend()
            client = self._client_of(backend)
            try:
                gen = client.generate(prompt_ids, sampling, abort_hook=self.ctx.on_abort)
            except BackendError as e:
                self.ctx.check()  # a deadline or cancellation explains the failure better
                self._fail_over(backend.id, str(e), mark=True)
                continue
            if gen.unchecked is not None:
                failed = self._await_check(backend.id, gen.unchecked)
                if failed:  # these tokens came from weights that failed: sampled again
                    self._fail_over(backend.id, failed, mark=False)
                    continue
            if self._lat[0] != backend.id:
                self._flush_latency()
                self._lat[0] = backend.id
            self._lat[1] += gen.latency_ms
            self._lat[2] += 1
            self._lat[3] += backend.in_flight  # the load its pin saw (at most PIN_TTL_S ago)
            return Turn(gen, backend)

    def _await_check(self, backend_id: str, version: int) -> str | None:
        """Wait for the farm's check of the weights ``version`` that backend loaded in place
        (some tokens were sampled between the engine's resume and the check's end): None
        once it passed (the backend serves that version), else why they are not kept."""
        end = time.monotonic() + CHECK_WAIT_S
        pause = 0.01
        while True:
            try:
                b = self.registry.get(backend_id)
            except NotFound:
                return f"backend {backend_id} was unregistered during a weight update"
            if b["weights"]["error"]:
                return f"its weights for version {version} failed: {b['weights']['error']}"
            if b["policy_version"] is not None and b["policy_version"] >= version:
                return None
            if time.monotonic() >= end:
                return (f"the check of its weights for version {version} did not end in "
                        f"{CHECK_WAIT_S:g} s")
            self.ctx.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _take_latency(self) -> tuple[str, float, int, float] | None:
        backend, total, n, load = self._lat
        self._lat = ["", 0.0, 0, 0]
        return (backend, total / n, n, load / n) if n else None

    def _flush_latency(self) -> None:
        latency = self._take_latency()
        if latency is not None:
            self.registry.record_latency(*latency)

    def close_client(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client, self._client_for = None, ()

    def close(self) -> None:
        """Record the last request's latency and close the connection (the job's backend
        slot stays pinned: it is freed when the job ends)."""
        self.close_client()
        self._flush_latency()

    def __enter__(self) -> BackendSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fail_over(self, backend_id: str, why: str, mark: bool, counted: bool = True
                   ) -> None:
        self.close_client()
        self._pinned = None
        if mark:
            self.registry.mark_unhealthy(backend_id, why)
        self.registry.release(self.ctx.job_id)
        self._exclude = backend_id
        self._last_failure = f"backend {backend_id}: {why}"
        if not counted:
            log.warning("job %s: backend %s left the heap (%s); moving to another",
                        self.ctx.job_id, backend_id, why)
            return
        self.failovers += 1
        log.warning("job %s: backend %s failed (%s); fail-over %d/%d", self.ctx.job_id,
                    backend_id, why, self.failovers, self.max_failovers)
        if self.failovers > self.max_failovers:
            raise BackendUnavailable(f"backend {backend_id} failed and fail-over is exhausted: "
                                     f"{why}")
