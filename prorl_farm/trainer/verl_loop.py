"""A VeRL agent loop backed by the farm: each sample VeRL's agent-loop worker hands it is
one farm job, and what comes back is the farm's trajectory as an ``AgentLoopOutput``.

VeRL (0.9.1; the v1 trainer and the agent-loop worker of the padded-batch trainer alike)
runs one ``AgentLoopBase.run`` per sample. This one submits the sample to the farm (one
job, its own batch), waits for it (one long-poll per worker process for all of its
samples), and returns the trajectory exactly as the farm recorded it: ``prompt_ids``,
``response_ids`` with ``response_mask`` (1 on sampled tokens, 0 on tool observations and
template glue) and ``response_logprobs``, ``reward_score`` (the farm's EVAL reward, so
VeRL's reward workers are not asked), ``num_turns`` (VeRL's count), and in
``extra_fields`` the job id, its policy versions and end reason. Nothing is re-tokenised.

- A failed job raises :class:`FarmRolloutFailed` (its failure kind and message): VeRL marks
  the sample's group failed (the v1 trainer pads or refills it, ``sync_refill_failed_
  groups``), never a zero reward.
- Cancelling the sample's task (VeRL cancelling a rollout) cancels the farm job.
- Logprobs of another mode than ``rollout.logprobs_mode`` (under sampling where the modes
  differ) are refused with the fix in the message (``adapters.check_logprobs_mode``).
- The response is cut at ``rollout.response_length`` and the prompt at
  ``rollout.prompt_length`` (from the left), as VeRL's own loops cut theirs.

Selected with an agent-loop config file (``actor_rollout_ref.rollout.agent.
agent_loop_config_path``), whose extra keys become this class's arguments::

    - name: prorl_farm
      _target_: prorl_farm.trainer.verl_loop.FarmAgentLoop
      farm_url: http://head:8000      # default: PRORL_URL
      handler: math                    # default: chat
      deadline_s: 1800
      max_tokens: 2048                 # per turn (default: rollout.response_length)

and ``agent_name: prorl_farm`` per sample (or ``rollout.agent.default_agent_loop``). The
sample's farm instance is ``extra_info["prorl_instance"]`` (its handler
``extra_info["prorl_handler"]``), or else ``{"messages": raw_prompt}`` with ``answer`` from
``reward_model["ground_truth"]`` where given. Imported only where VeRL is installed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from prorl_farm.config import read
from prorl_farm.errors import FarmError
from prorl_farm.trainer.adapters import check_logprobs_mode, mask_runs
from prorl_farm.trainer.farm import FarmClient

log = logging.getLogger(__name__)

# The long-poll of the shared waiter (seconds), and how often a quiet one looks again.
WAIT_S = 10.0


class FarmRolloutFailed(FarmError, RuntimeError):
    """The farm job of a sample failed or was cancelled: no trajectory, no reward."""

    def __init__(self, job: dict):
        failure = job.get("failure") or {}
        super().__init__(f"farm job {job.get('id')} {job.get('state')}: "
                         f"{failure.get('kind')}: {failure.get('message', '')[:500]}")
        self.job = job
        self.kind = failure.get("kind")


class _Waiter:
    """One thread per process and farm that long-polls every pending sample's batch in one
    request (``POST /v1/batches/results``) and hands each finished job to its coroutine."""

    _instances: dict[str, _Waiter] = {}
    _lock = threading.Lock()

    @classmethod
    def of(cls, url: str) -> _Waiter:
        with cls._lock:
            if url not in cls._instances:
                cls._instances[url] = cls(url)
            return cls._instances[url]

    def __init__(self, url: str):
        self.farm = FarmClient(url, timeout_s=60)
        self.pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self.cond = threading.Condition()
        threading.Thread(target=self._loop, name="prorl-farm-waiter", daemon=True).start()

    def wait(self, batch_id: str) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.cond:
            self.pending[batch_id] = (loop, future)
            self.cond.notify()
        return future

    def forget(self, batch_id: str) -> None:
        with self.cond:
            self.pending.pop(batch_id, None)

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.pending:
                    self.cond.wait()
                batches = list(self.pending)[:1000]
            try:
                pages = self.farm.results_many(dict.fromkeys(batches, "0-0"), limit=1,
                                               wait_s=WAIT_S)
            except Exception as e:  # noqa: BLE001 - every waiting sample hears of it
                self._settle({b: e for b in batches})
                continue
            done = {}
            for batch_id, page in pages.items():
                if not page.get("found"):
                    done[batch_id] = FarmError(f"farm batch {batch_id} is gone")
                elif page["results"]:
                    done[batch_id] = page["results"][0]
            self._settle(done)

    def _settle(self, outcomes: dict[str, Any]) -> None:
        for batch_id, outcome in outcomes.items():
            with self.cond:
                entry = self.pending.pop(batch_id, None)
            if entry is None:
                continue
            loop, future = entry

            def deliver(future=future, outcome=outcome):
                if future.done():
                    return
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

            loop.call_soon_threadsafe(deliver)


@register("prorl_farm")
class FarmAgentLoop(AgentLoopBase):
    def __init__(self, *args, farm_url: str | None = None, handler: str = "chat",
                 deadline_s: float | None = None, max_tokens: int | None = None, **kwargs):
        kwargs.pop("tools", None)
        super().__init__(*args, **kwargs)
        self.farm_url = farm_url or read("url")
        self.handler = handler
        self.deadline_s = deadline_s
        self.prompt_length = self.rollout_config.prompt_length
        self.response_length = self.rollout_config.response_length
        self.max_tokens = int(max_tokens or self.response_length)

    def _instance(self, kwargs: dict) -> tuple[str, dict]:
        extra = kwargs.get("extra_info") or {}
        if extra.get("prorl_instance") is not None:
            return extra.get("prorl_handler") or self.handler, dict(extra["prorl_instance"])
        instance: dict = {"messages": [dict(m) for m in kwargs["raw_prompt"]]}
        truth = (kwargs.get("reward_model") or {}).get("ground_truth")
        if truth is not None:
            instance["answer"] = str(truth)
        return extra.get("prorl_handler") or self.handler, instance

    def _sampling(self, params: dict) -> dict:
        sampling = {"max_tokens": self.max_tokens}
        for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
            if params.get(key) is not None:
                sampling[key] = params[key]
        return sampling

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        handler, instance = self._instance(kwargs)
        farm = FarmClient(self.farm_url)
        loop = asyncio.get_running_loop()
        waiter = _Waiter.of(self.farm_url)
        try:
            sub = await loop.run_in_executor(None, lambda: farm.submit(
                handler, [instance], n=1, sampling=self._sampling(sampling_params),
                deadline_s=self.deadline_s))
            batch_id = sub["batch_id"]
            try:
                job = await waiter.wait(batch_id)
            except asyncio.CancelledError:
                waiter.forget(batch_id)
                await asyncio.shield(loop.run_in_executor(None, farm.cancel_batch, batch_id))
                raise
        finally:
            farm.http.close()
        if job["state"] != "done":
            raise FarmRolloutFailed(job)
        # The logprobs must be what VeRL's actor computes (rollout.logprobs_mode): a
        # mismatch is refused loudly, never trained on.
        check_logprobs_mode([(0, job)], getattr(self.rollout_config, "logprobs_mode", None))
        return self._output(job)

    def _output(self, job: dict) -> AgentLoopOutput:
        res = job["result"]
        prompt = [int(x) for x in res["prompt_ids"]]
        if len(prompt) > self.prompt_length:
            prompt = prompt[-self.prompt_length:]
        n = self.response_length
        ids = [int(x) for x in res["response_ids"][:n]]
        mask = [int(x) for x in res["response_mask"][:n]]
        logprobs = [float(x) for x in res["response_logprobs"][:n]]
        turns = res.get("turns") or []
        return AgentLoopOutput(
            prompt_ids=prompt, response_ids=ids, response_mask=mask,
            response_logprobs=logprobs, reward_score=float(job["reward"]),
            num_turns=1 + len(mask_runs(mask)), metrics=AgentLoopMetrics(),
            extra_fields={"prorl_job_id": job["id"],
                          "policy_version": job.get("policy_version"),
                          "policy_versions": [t.get("policy_version") for t in turns],
                          "logprobs_mode": sorted({t.get("logprobs_mode") for t in turns
                                                   if t.get("logprobs_mode")}),
                          "end_reason": (res.get("stats") or {}).get("end_reason"),
                          "turn_scores": [], "tool_rewards": []})
