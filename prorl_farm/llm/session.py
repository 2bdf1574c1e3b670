"""A job's sticky connection to the LLM backends: every turn to the backend the job is
pinned to, fail-over once to another if that backend fails, never hang."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prorl_farm.context import JobContext
from prorl_farm.errors import BackendError, BackendUnavailable
from prorl_farm.llm.clients import Generation, client_for
from prorl_farm.llm.registry import Backend, BackendRegistry

log = logging.getLogger(__name__)


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


class BackendSession:
    def __init__(self, registry: BackendRegistry, ctx: JobContext, max_failovers: int = 1,
                 request_timeout_s: float = 600.0, retries: int = 2):
        self.registry = registry
        self.ctx = ctx
        self.max_failovers = max_failovers
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.failovers = 0
        self._exclude = ""
        # The tokenizer of the first backend the job got: a fail-over to a backend with
        # another one would mix token vocabularies in one trajectory.
        self.tokenizer: str | None = None

    def backend(self) -> Backend:
        """The backend this job is pinned to (pinning it now if it is not yet)."""
        while True:
            backend_id = self.registry.acquire(self.ctx.job_id, self._exclude)
            if backend_id is None:
                raise BackendUnavailable("no healthy, undrained LLM backend is registered")
            backend = self.registry.backend(backend_id)
            if backend is not None:
                if self.tokenizer is None:
                    self.tokenizer = backend.tokenizer
                elif backend.tokenizer != self.tokenizer:
                    raise BackendUnavailable(f"fail-over backend {backend.id} uses another "
                                             f"tokenizer ({backend.tokenizer})")
                return backend
            # Unregistered between acquire and read: the next acquire re-pins the job.
            self._fail_over(backend_id, "backend was unregistered", mark=False)

    def generate(self, prompt_ids: list[int], sampling: dict) -> Turn:
        while True:
            self.ctx.check()
            backend = self.backend()
            client = client_for(backend.kind, backend.url, backend.model,
                                timeout_s=min(self.request_timeout_s,
                                              max(1.0, self.ctx.remaining_s)),
                                retries=self.retries,
                                headers={"X-Prorl-Job": self.ctx.job_id})
            try:
                gen = client.generate(prompt_ids, sampling, abort_hook=self.ctx.on_abort)
            except BackendError as e:
                self.ctx.check()  # a deadline or cancellation explains the failure better
                self._fail_over(backend.id, str(e), mark=True)
                continue
            self.registry.record_latency(backend.id, gen.latency_ms)
            return Turn(gen, backend)

    def _fail_over(self, backend_id: str, why: str, mark: bool) -> None:
        if mark:
            self.registry.mark_unhealthy(backend_id, why)
        self.registry.release(self.ctx.job_id)
        self._exclude = backend_id
        self.failovers += 1
        log.warning("job %s: backend %s failed (%s); fail-over %d/%d", self.ctx.job_id,
                    backend_id, why, self.failovers, self.max_failovers)
        if self.failovers > self.max_failovers:
            raise BackendUnavailable(f"backend {backend_id} failed and fail-over is exhausted: "
                                     f"{why}")
