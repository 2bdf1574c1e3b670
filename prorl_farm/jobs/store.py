"""The Redis job store: creating jobs, atomic stage transitions, batch summaries and streams."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from prorl_farm.config import Settings
from prorl_farm.errors import NotFound
from prorl_farm.jobs import keys, scripts
from prorl_farm.jobs.states import ALL_STATES, JobState

log = logging.getLogger(__name__)

def connect(settings: Settings, max_connections: int = 64) -> redis.Redis:
    """A Redis client for a process with many threads: callers wait for a free connection
    (never fail for want of one), and transient connection errors are retried."""
    if not settings.redis_url:
        raise ValueError("PRORL_REDIS_URL is not set")
    pool = redis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=max_connections, timeout=30,
        decode_responses=True, health_check_interval=30)
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5)
    return redis.Redis(connection_pool=pool, retry=retry,
                       retry_on_error=[redis.exceptions.ConnectionError,
                                       redis.exceptions.TimeoutError])


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class NewJob:
    """A job as created at submit time: its id and the token of its INIT message."""

    job_id: str
    token: str


@dataclass(frozen=True)
class Finished:
    """Outcome of a terminal transition."""

    changed: bool
    old_state: str = ""
    old_phase: str = ""
    old_token: str = ""


class JobStore:
    """All reads and writes of job state. Thread-safe (redis-py pools connections)."""

    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        self._scripts = {
            name: client.register_script(scripts.PRELUDE + getattr(scripts, name))
            for name in ("CLAIM", "ADVANCE", "HANDED_OFF", "FINISH", "HEARTBEAT", "REAP",
                         "EXPIRE_DEADLINES")
        }

    @classmethod
    def from_settings(cls, settings: Settings, max_connections: int = 64) -> JobStore:
        return cls(connect(settings, max_connections), settings)

    def _call(self, name: str, *args):
        return self._scripts[name](args=[keys.PREFIX, *args])

    @property
    def _ttl(self) -> int:
        return int(self.settings.result_ttl_s)

    # -- submit -------------------------------------------------------------------------

    def create_jobs(
        self,
        batch_id: str,
        handler: str,
        instances: Sequence[dict],
        n: int,
        sampling: dict,
        deadline_s: float | None,
    ) -> list[NewJob]:
        """Write every job of one request atomically (MULTI/EXEC), all waiting for INIT."""
        now = self.server_time()
        deadline_at = f"{now + deadline_s:.6f}" if deadline_s else ""
        sampling_json = json.dumps(sampling)
        jobs: list[NewJob] = []
        pipe = self.r.pipeline(transaction=True)
        for index, instance in enumerate(instances):
            instance_json = json.dumps(instance)
            for sample in range(n):
                job = NewJob(new_id(), new_id())
                jobs.append(job)
                pipe.hset(keys.job(job.job_id), mapping={
                    "id": job.job_id, "batch_id": batch_id, "handler": handler,
                    "instance": instance_json, "instance_index": index, "sample_index": sample,
                    "sampling": sampling_json, "state": JobState.QUEUED.value, "stage": "init",
                    "phase": "waiting", "token": job.token, "queue": "init", "requeues": 0,
                    "created_at": f"{now:.6f}", "t_init_queued": f"{now:.6f}",
                    "deadline_at": deadline_at,
                })
        ids = [j.job_id for j in jobs]
        pipe.hsetnx(keys.batch(batch_id), "created_at", f"{now:.6f}")
        pipe.hincrby(keys.batch(batch_id), "total", len(jobs))
        pipe.hincrby(keys.batch_counts(batch_id), JobState.QUEUED.value, len(jobs))
        pipe.rpush(keys.batch_jobs(batch_id), *ids)
        pipe.zadd(keys.queued("init"), {i: now for i in ids})
        pipe.sadd(keys.QUEUES, "init")
        if deadline_s:
            pipe.zadd(keys.DEADLINES, {i: now + deadline_s for i in ids})
        pipe.execute()
        return jobs

    # -- stage transitions ----------------------------------------------------------------

    def claim(self, job_id: str, stage: str, token: str, worker: str) -> tuple[str, dict]:
        """Claim ``stage`` of a job for ``worker``: ("ok", job fields) or (reason, {})."""
        out = self._call("CLAIM", job_id, stage, token, worker, self._ttl)
        if out[0] != "ok":
            return out[0], {}
        flat = out[1]
        return "ok", dict(zip(flat[::2], flat[1::2]))

    def advance(self, job_id: str, from_stage: str, token: str, to_stage: str, queue: str,
                node: str, field: str, value: str) -> str | None:
        """Move a job to the next stage's queue; returns its new token, or None if stale."""
        new_token = new_id()
        out = self._call("ADVANCE", job_id, from_stage, token, to_stage, new_token, queue,
                         node, field, value)
        return new_token if out == "ok" else None

    def handed_off(self, pairs: Iterable[tuple[str, str]]) -> None:
        """The messages for these (job, new token) pairs are published: stop heartbeating."""
        flat = [x for pair in pairs for x in pair]
        if flat:
            self._call("HANDED_OFF", *flat)

    def finish(self, job_id: str, state: JobState, kind: str = "", message: str = "",
               token: str = "", fields: dict | None = None) -> Finished:
        """Put a job in a terminal state (once); with ``token``, only from that active attempt."""
        flat: list = []
        for k, v in (fields or {}).items():
            flat += [k, v]
        out = self._call("FINISH", job_id, token, state.value, kind, message[:4000],
                         self._ttl, *flat)
        if not out.startswith("ok:"):
            return Finished(False, old_state=out.partition(":")[2])
        _, old_state, old_phase, old_token = out.split(":", 3)
        return Finished(True, old_state, old_phase, old_token)

    def heartbeat(self, held: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """Refresh heartbeats of (job, token) pairs; return the pairs to abort."""
        flat = [x for pair in held for x in pair]
        if not flat:
            return []
        out = self._call("HEARTBEAT", *flat)
        return list(zip(out[::2], out[1::2]))

    def reap(self, job_id: str, mode: str, cutoff: float, queue: str, message: str
             ) -> tuple[str, str]:
        """Recover one job whose worker is dead; returns (outcome, new token if requeued)."""
        token = new_id()
        out = self._call("REAP", job_id, mode, cutoff, queue, self.settings.max_requeues,
                         token, self._ttl, message)
        return out, token

    def expire_deadlines(self, limit: int = 1000) -> int:
        return int(self._call("EXPIRE_DEADLINES", self._ttl, limit))

    # -- reads ----------------------------------------------------------------------------

    def get_raw(self, job_id: str) -> dict:
        raw = self.r.hgetall(keys.job(job_id))
        if not raw:
            raise NotFound(f"job {job_id!r} not found")
        return raw

    def state_of(self, job_id: str) -> str | None:
        """The job's state, or None when it does not exist (any more)."""
        return self.r.hget(keys.job(job_id), "state")

    def get_many_raw(self, job_ids: Sequence[str]) -> list[dict]:
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        return pipe.execute()

    def batch_exists(self, batch_id: str) -> bool:
        return bool(self.r.exists(keys.batch(batch_id)))

    def batch_summary(self, batch_id: str) -> dict:
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(keys.batch(batch_id))
        pipe.hgetall(keys.batch_counts(batch_id))
        meta, counts = pipe.execute()
        if not meta:
            raise NotFound(f"batch {batch_id!r} not found")
        counts = {s: int(counts.get(s, 0)) for s in ALL_STATES}
        terminal = counts["done"] + counts["failed"] + counts["cancelled"]
        return {
            "batch_id": batch_id,
            "total": int(meta.get("total", 0)),
            "counts": counts,
            "finished": terminal,
            "complete": terminal == int(meta.get("total", 0)),
            "created_at": float(meta.get("created_at", 0)),
        }

    def batch_job_ids(self, batch_id: str) -> list[str]:
        return self.r.lrange(keys.batch_jobs(batch_id), 0, -1)

    def batch_results(self, batch_id: str, cursor: str, limit: int, wait_s: float
                      ) -> tuple[list[dict], str]:
        """Finished jobs after ``cursor`` in the order they finished; blocks up to ``wait_s``."""
        if not self.batch_exists(batch_id):
            raise NotFound(f"batch {batch_id!r} not found")
        stream = keys.batch_stream(batch_id)
        entries = self.r.xrange(stream, min=f"({cursor}", count=limit)
        if not entries and wait_s > 0:
            got = self.r.xread({stream: cursor}, count=limit, block=max(1, int(wait_s * 1000)))
            entries = got[0][1] if got else []
        if not entries:
            return [], cursor
        raws = self.get_many_raw([fields["job"] for _, fields in entries])
        return [r for r in raws if r], entries[-1][0]

    # -- pools ----------------------------------------------------------------------------

    def server_time(self) -> float:
        """Redis's clock (epoch seconds): the one clock every node's timings agree on."""
        secs, micros = self.r.time()
        return secs + micros / 1e6

    def pool_beat(self, stage: str, node: str) -> None:
        self.r.zadd(keys.POOLS, {f"{stage}:{node}": self.server_time()})

    def live_pools(self, max_age_s: float) -> dict[str, float]:
        """Pools ("<stage>:<node>") that heartbeat within ``max_age_s``, with their age."""
        now = self.server_time()
        rows = self.r.zrangebyscore(keys.POOLS, now - max_age_s, "+inf", withscores=True)
        return {member: round(now - score, 3) for member, score in rows}
