"""Dynamic sampling (DAPO) with asynchronous replenishment, on the trainer side.

A training step asks for ``batch_groups`` prompt groups of ``n`` rollouts each. A group
whose rewards all agree carries no gradient signal in GRPO/DAPO (its advantages are all
zero), so the sampler drops it and keeps more groups in flight than the step needs, sized
from the acceptance rate it has observed, topping the farm up as groups finish instead of
waiting for a whole wave. It returns as soon as ``batch_groups`` groups qualify. What is
still running then is either cancelled (the paper's stale-job cleanup) or carried into the
next step, as are qualified groups the step did not need, as long as they are at most
``staleness`` policy versions old; older ones are cancelled or dropped.

Staleness is the oldest *token's*: with weight updates in place a rollout goes on across
an update, its tokens tagged with the version that sampled each, and the bound applies to
its ``min_version``, not to the version it was submitted at. A group still in flight when
the policy moves on is kept (``stale_in_flight="keep"``: its rollouts may not have
started) and judged by its tokens when it finishes; ``"cancel"`` cancels it at once.
Each step's stats say how stale what it returns is (versions behind the step's policy:
per rollout, of its oldest token, mean and max; and per sampled token) and how long those
rollouts waited in the farm's queues against how long they ran.

No step waits on one straggler: ``group_min_done=k`` ends a group as soon as ``k`` of its
rollouts finished and their rewards vary (the rest cancelled, or with
``group_rest="carry"`` left running and trained later as a group of their own); with
``min_groups`` the step ends once that many groups qualified and ``straggler_grace_s``
passed without the rest. What a stop cut is counted in the stats (``rollouts_cut``,
``rollouts_carried``, ``groups_short``), never returned as a reward.

    farm = FarmClient(url)
    sampler = DynamicSampler(farm, prompts, handler="math", n=8, batch_groups=32)
    for step in range(steps):
        batch = sampler.next_batch(policy_version=step)   # list[Group]
        ...   # adapters: prorl_farm.trainer.adapters
        print(batch.stats)
    sampler.close()

Each group is submitted as its own batch (one instance, ``n`` samples), so a group is
cancelled with one request; the results of every group in flight come back in one
long-polled request (``FarmClient.results_many``), however many groups there are.
Failed rollouts (a job that failed or timed out) are never a zero reward:
``on_failure="drop_group"`` drops the group, ``"drop_rollout"`` keeps the group's other
rollouts if at least two remain and their rewards vary.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prorl_farm.trainer.adapters import token_versions
from prorl_farm.trainer.farm import FarmClient, FarmNotFound

# Groups whose results one request fetches (the API's limit).
POLL_CHUNK = 1000


@dataclass
class Group:
    """One prompt's rollouts."""

    instance: dict
    batch_id: str
    job_ids: list[str]
    submitted_version: int
    submitted_at: float
    jobs: dict[str, dict] = field(default_factory=dict)  # finished, by id
    cursor: str = "0-0"
    # 0: the prompt's group as submitted; 1, 2, ...: rollouts a group's early stop left
    # running, carried on as a group of their own (same batch).
    part: int = 0

    @property
    def uid(self) -> str:
        """The group's identity for advantage grouping (VeRL's ``uid``)."""
        return self.batch_id if not self.part else f"{self.batch_id}/{self.part}"

    @property
    def done(self) -> bool:
        return len(self.jobs) == len(self.job_ids)

    @property
    def rollouts(self) -> list[dict]:
        """The finished jobs, in sample order."""
        return [self.jobs[j] for j in self.job_ids if j in self.jobs]

    @property
    def rewards(self) -> list[float]:
        return [j["reward"] for j in self.rollouts if j["state"] == "done"]

    @property
    def policy_version(self) -> int:
        """The oldest policy version among its rollouts' turns (the version at submit where
        a rollout made no LLM turn)."""
        versions = [j.get("policy_version") for j in self.rollouts]
        return min([v for v in versions if v is not None] or [self.submitted_version])

    @property
    def stale_known(self) -> int | None:
        """The oldest version among the rollouts finished so far (None: none with a turn)."""
        versions = [j.get("policy_version") for j in self.jobs.values()
                    if j.get("state") == "done"]
        return min([v for v in versions if v is not None], default=None)


@dataclass
class StepStats:
    step: int
    accepted: int = 0
    filtered_zero_variance: int = 0
    filtered_failed: int = 0
    dropped_stale: int = 0
    rollouts_dropped: int = 0  # failed rollouts dropped from groups kept
    rollouts_wasted: int = 0  # finished or cancelled rollouts that no step trained on
    carried_in: int = 0  # groups this step started with (finished or in flight)
    submitted_groups: int = 0
    wait_s: float = 0.0
    in_flight_mean: float = 0.0  # rollouts in flight, averaged over the wait
    utilisation: float | None = None  # in_flight_mean / the backends' total capacity
    acceptance_rate: float = 0.0
    # Over every rollout that finished (done) in the groups judged this step, kept or not:
    # the policy's mean reward, unbiased by the filter.
    reward_mean: float | None = None
    rollouts_judged: int = 0
    # How stale the returned rollouts are, in versions behind the step's policy: of each
    # rollout's oldest token (mean, max), and over every sampled token.
    staleness_mean: float | None = None
    staleness_max: int | None = None
    token_staleness_mean: float | None = None
    # The returned rollouts' time in the farm's queues vs running (mean seconds per
    # rollout, over its stages).
    queue_wait_mean_s: float | None = None
    active_mean_s: float | None = None
    # Straggler stops: groups ended early (the rest cancelled: rollouts_cut; or left
    # running as groups of their own: rollouts_carried), and groups the step ended
    # without (min_groups reached and the grace passed).
    groups_stopped_early: int = 0
    rollouts_cut: int = 0
    rollouts_carried: int = 0
    groups_short: int = 0


@dataclass
class Batch:
    groups: list[Group]
    stats: StepStats

    def __iter__(self) -> Iterator[Group]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)


class DynamicSampler:
    def __init__(self, farm: FarmClient, prompts: Iterable[dict], handler: str, n: int,
                 batch_groups: int, sampling: dict | None = None,
                 rollout_deadline_s: float | None = None, carry: bool = True,
                 staleness: int = 1, on_failure: str = "drop_group",
                 max_groups_in_flight: int | None = None, overprovision: float = 1.25,
                 prior_acceptance: float = 0.5, poll_wait_s: float = 0.5,
                 max_groups_per_step: int | None = None, stale_in_flight: str = "keep",
                 group_min_done: int | None = None, group_rest: str = "cancel",
                 min_groups: int | None = None, straggler_grace_s: float = 0.0):
        if on_failure not in ("drop_group", "drop_rollout"):
            raise ValueError("on_failure: drop_group or drop_rollout")
        if stale_in_flight not in ("keep", "cancel"):
            raise ValueError("stale_in_flight: keep or cancel")
        if group_rest not in ("cancel", "carry"):
            raise ValueError("group_rest: cancel or carry")
        if group_min_done is not None and not 2 <= group_min_done <= n:
            raise ValueError(f"group_min_done must be between 2 and n ({n})")
        if min_groups is not None and not 1 <= min_groups <= batch_groups:
            raise ValueError(f"min_groups must be between 1 and batch_groups ({batch_groups})")
        if n < 2:
            raise ValueError("dynamic sampling needs n >= 2 rollouts per group")
        self.farm = farm
        self.prompts = iter(prompts)
        self.handler = handler
        self.n = n
        self.batch_groups = batch_groups
        self.sampling = sampling or {}
        self.rollout_deadline_s = rollout_deadline_s
        self.carry = carry
        self.staleness = staleness
        self.on_failure = on_failure
        self.max_groups_in_flight = max_groups_in_flight or 4 * batch_groups
        if max_groups_per_step is not None and max_groups_per_step < 1:
            raise ValueError("max_groups_per_step must be at least 1")
        # A step submits at most this many groups, then returns with what qualified once
        # they are in: once the policy answers most prompts all right (or all wrong),
        # finding the last groups costs the most. (VeRL's DAPO bounds generation rounds the
        # same way with max_num_gen_batches, but stops training with an error there.)
        self.max_groups_per_step = max_groups_per_step
        self.stale_in_flight = stale_in_flight
        self.group_min_done = group_min_done
        self.group_rest = group_rest
        self.min_groups = min_groups
        self.straggler_grace_s = straggler_grace_s
        self.overprovision = overprovision
        self.poll_wait_s = poll_wait_s
        # Observed acceptance (accepted / finished groups), with a prior worth 4 groups.
        self._seen = 4.0
        self._accepted = 4.0 * prior_acceptance
        self.in_flight: list[Group] = []
        self.ready: list[Group] = []  # qualified, not yet trained on
        self.exhausted = False
        self.batch_ids: list[str] = []  # every group's batch, for audits
        self.step = 0
        self.history: list[StepStats] = []
        self._stats = StepStats(step=0)
        self._parts: dict[str, int] = {}  # batch id: carried parts so far

    # -- the acceptance rule -----------------------------------------------------------------

    def _judge(self, group: Group, stats: StepStats) -> bool:
        """Whether a finished group qualifies; trims failed rollouts under drop_rollout."""
        failed = [j for j in group.rollouts if j["state"] != "done"]
        if failed:
            if self.on_failure == "drop_group" or len(group.rewards) < 2:
                stats.filtered_failed += 1
                stats.rollouts_wasted += len(group.job_ids)
                return False
            for job in failed:
                group.jobs.pop(job["id"])
                group.job_ids.remove(job["id"])
            stats.rollouts_dropped += len(failed)
        if len(set(group.rewards)) < 2:
            stats.filtered_zero_variance += 1
            stats.rollouts_wasted += len(group.job_ids)
            return False
        return True

    @property
    def acceptance_rate(self) -> float:
        return self._accepted / self._seen

    # -- the farm side -------------------------------------------------------------------------

    def _submit(self, count: int, version: int, stats: StepStats) -> None:
        for instance in itertools.islice(self.prompts, count):
            sub = self.farm.submit(self.handler, [instance], n=self.n, sampling=self.sampling,
                                   deadline_s=self.rollout_deadline_s)
            self.in_flight.append(Group(instance, sub["batch_id"], sub["job_ids"], version,
                                        time.monotonic()))
            self.batch_ids.append(sub["batch_id"])
            stats.submitted_groups += 1
            count -= 1
        if count > 0:
            self.exhausted = True

    def _wanted_in_flight(self, missing: int) -> int:
        if missing <= 0:
            return 0
        rate = max(self.acceptance_rate, 0.05)
        return min(self.max_groups_in_flight, math.ceil(missing / rate * self.overprovision))

    def _poll(self, wait_s: float) -> list[Group]:
        """Fetch new results of every group in flight with one request per 1,000 groups
        (long-polled up to ``wait_s`` while none has any); returns the groups that
        finished."""
        finished: list[Group] = []
        groups = list(self.in_flight)
        for i in range(0, len(groups), POLL_CHUNK):
            chunk = {g.batch_id: g for g in groups[i:i + POLL_CHUNK]}
            pages = self.farm.results_many({b: g.cursor for b, g in chunk.items()},
                                           limit=1000, wait_s=wait_s if i == 0 else 0.0)
            for batch_id, group in chunk.items():
                page = pages.get(batch_id) or {"found": False}
                if not page.get("found"):  # expired: its rollouts count as failed
                    for job_id in group.job_ids:
                        group.jobs.setdefault(job_id, {"id": job_id, "state": "failed",
                                                       "reward": None, "policy_version": None})
                else:
                    group.cursor = page["cursor"]
                    for job in page["results"]:
                        group.jobs[job["id"]] = job
                if group.done:
                    finished.append(group)
                    self.in_flight.remove(group)
                elif self._stop_early(group):
                    finished.append(group)
        return finished

    def _stop_early(self, group: Group) -> bool:
        """``group_min_done``: end a group in flight once that many of its rollouts are done
        and their rewards vary (under ``drop_group``, none failed). The unfinished rest is
        cancelled, or carried on as a group of its own (``group_rest="carry"``; a single
        rollout is no group and is cancelled)."""
        if self.group_min_done is None or group.done:
            return False
        done = [j for j in group.rollouts if j["state"] == "done"]
        failed = len(group.jobs) - len(done)
        if (len(done) < self.group_min_done or len({j["reward"] for j in done}) < 2
                or (failed and self.on_failure == "drop_group")):
            return False
        rest = [j for j in group.job_ids if j not in group.jobs]
        group.job_ids = [j for j in group.job_ids if j in group.jobs]
        self.in_flight.remove(group)
        stats = self._stats
        stats.groups_stopped_early += 1
        if self.group_rest == "carry" and len(rest) >= 2:
            self._parts[group.batch_id] = part = self._parts.get(group.batch_id, 0) + 1
            self.in_flight.append(Group(group.instance, group.batch_id, rest,
                                        group.submitted_version, group.submitted_at,
                                        cursor=group.cursor, part=part))
            stats.rollouts_carried += len(rest)
        else:  # the batch's other jobs are terminal: this cancels the rest only
            try:
                self.farm.cancel_batch(group.batch_id)
            except FarmNotFound:
                pass
            stats.rollouts_cut += len(rest)
            stats.rollouts_wasted += len(rest)
        return True

    def _cancel(self, groups: list[Group], stats: StepStats) -> None:
        for group in groups:
            try:
                self.farm.cancel_batch(group.batch_id)
            except FarmNotFound:
                pass
            stats.rollouts_wasted += len(group.job_ids)

    def _capacity(self) -> int | None:
        try:
            total = sum(b["capacity"] for b in self.farm.backends()
                        if b["healthy"] and not b["drained"])
        except Exception:  # noqa: BLE001 - utilisation is a nicety
            return None
        return total or None

    # -- a step ------------------------------------------------------------------------------

    def next_batch(self, policy_version: int, timeout_s: float | None = None) -> Batch:
        """Block until ``batch_groups`` groups qualify (or the prompts run out, or the step
        has submitted ``max_groups_per_step`` groups and they are in, or ``timeout_s``
        passes: then the batch has fewer); returns them with the step's stats."""
        stats = self._stats = StepStats(step=self.step)
        self.step += 1
        oldest = policy_version - self.staleness
        self._drop_stale(oldest, stats)
        accepted: list[Group] = self.ready[:self.batch_groups]
        self.ready = self.ready[self.batch_groups:]
        start = time.monotonic()
        end = None if timeout_s is None else start + timeout_s
        samples = []
        rewards: list[float] = []
        enough_at = None  # when min_groups qualified
        while len(accepted) < self.batch_groups:
            if self.min_groups is not None and len(accepted) >= self.min_groups:
                enough_at = enough_at or time.monotonic()
                if time.monotonic() - enough_at >= self.straggler_grace_s:
                    stats.groups_short = self.batch_groups - len(accepted)
                    break
            missing = self.batch_groups - len(accepted)
            want = self._wanted_in_flight(missing) - len(self.in_flight)
            if self.max_groups_per_step is not None:
                want = min(want, self.max_groups_per_step - stats.submitted_groups)
            if want > 0 and not self.exhausted:
                self._submit(want, policy_version, stats)
            if not self.in_flight:
                break  # the prompts or the step's budget ran out
            if end is not None and time.monotonic() >= end:
                break
            samples.append(sum(len(g.job_ids) - len(g.jobs) for g in self.in_flight))
            wait = self.poll_wait_s if end is None else max(
                0.0, min(self.poll_wait_s, end - time.monotonic()))
            if enough_at is not None:
                wait = max(0.0, min(wait, enough_at + self.straggler_grace_s
                                    - time.monotonic()))
            for group in self._poll(wait):
                self._seen += 1
                rewards += group.rewards
                if group.policy_version < oldest:
                    stats.dropped_stale += 1
                    stats.rollouts_wasted += len(group.job_ids)
                elif self._judge(group, stats):
                    self._accepted += 1
                    if len(accepted) < self.batch_groups:
                        accepted.append(group)
                    else:
                        self.ready.append(group)
        stats.wait_s = round(time.monotonic() - start, 3)
        return self._end_step(stats, accepted, rewards, samples, policy_version)

    def _drop_stale(self, oldest: int, stats: StepStats) -> None:
        """What the last step left: stale groups go, fresh ones count (carried in). In
        flight, a group is stale where a finished rollout's oldest token is (the group is
        judged by its oldest), or, with stale_in_flight="cancel", where it was submitted."""
        stale_ready = [g for g in self.ready if g.policy_version < oldest]
        self.ready = [g for g in self.ready if g.policy_version >= oldest]
        stats.dropped_stale += len(stale_ready)
        stats.rollouts_wasted += sum(len(g.job_ids) for g in stale_ready)
        stale = [g for g in self.in_flight
                 if (g.stale_known is not None and g.stale_known < oldest)
                 or (self.stale_in_flight == "cancel" and g.submitted_version < oldest)]
        self.in_flight = [g for g in self.in_flight if g not in stale]
        self._cancel(stale, stats)
        stats.dropped_stale += len(stale)
        stats.carried_in = len(self.ready) + len(self.in_flight)

    def _end_step(self, stats: StepStats, accepted: list[Group], rewards: list[float],
                  samples: list[int], policy_version: int) -> Batch:
        """The step's batch and stats; without carry-over, what is left is cancelled."""
        if not self.carry:
            self._cancel(self.in_flight, stats)
            self.in_flight = []
            stats.rollouts_wasted += sum(len(g.job_ids) for g in self.ready)
            self.ready = []
        stats.accepted = len(accepted)
        stats.rollouts_judged = len(rewards)
        stats.reward_mean = round(sum(rewards) / len(rewards), 4) if rewards else None
        stats.in_flight_mean = round(sum(samples) / len(samples), 2) if samples else 0.0
        capacity = self._capacity()
        if capacity:
            stats.utilisation = round(min(1.0, stats.in_flight_mean / capacity), 3)
        stats.acceptance_rate = round(self.acceptance_rate, 3)
        _age(stats, accepted, policy_version)
        self.history.append(stats)
        return Batch(accepted, stats)

    def close(self) -> None:
        """Cancel everything still in flight (nothing is left running on the farm)."""
        self._cancel(self.in_flight, StepStats(step=self.step))
        self.in_flight = []
        self.ready = []

    def __enter__(self) -> DynamicSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _age(stats: StepStats, groups: list[Group], policy_version: int) -> None:
    """The step's staleness and queue/active time, over the rollouts it returns."""
    behind, token_behind, queued, active = [], [], [], []
    for group in groups:
        for job in group.rollouts:
            if job.get("state") != "done":
                continue
            result = job.get("result") or {}
            oldest = job.get("policy_version")
            if oldest is not None:
                behind.append(policy_version - oldest)
            if result.get("response_ids") is not None and result.get("response_mask") is not None:
                versions = token_versions(result, oldest)
                token_behind += (policy_version - versions[versions >= 0]).tolist()
            timings = job.get("timings") or {}
            stages = [t for t in timings.values() if isinstance(t, dict)]
            if stages:
                queued.append(sum(t.get("queue_wait_s") or 0.0 for t in stages))
                active.append(sum(t.get("active_s") or 0.0 for t in stages))
    stats.staleness_mean = _mean(behind)
    stats.staleness_max = max(behind, default=None)
    stats.token_staleness_mean = _mean(token_behind)
    stats.queue_wait_mean_s = _mean(queued)
    stats.active_mean_s = _mean(active)
