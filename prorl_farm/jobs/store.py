"""The Redis job store: creating jobs, atomic stage transitions, batch summaries and streams."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

import redis

from prorl_farm import counters, keys, redisconn
from prorl_farm.config import Settings
from prorl_farm.errors import ConfigError, NotFound
from prorl_farm.jobs.messages import StageMessages
from prorl_farm.lua import Scripts
from prorl_farm.states import (
    ALL_STATES,
    CLAIM_FIELDS,
    MAX_ATTEMPT_HISTORY,
    STATE_SLOT,
    Claim,
    JobState,
    Reap,
)
from prorl_farm.tenants import batch_tenant

log = logging.getLogger(__name__)


# A blocking read (the results long-poll) may take this much longer than it asked for before
# the socket gives up: the socket timeout is max_wait_s plus this.
SOCKET_SLACK_S = 30.0
# Jobs whose publish is recorded per handed_off call.
HANDED_OFF_CHUNK = 2000
# Jobs per create_jobs call of a submission (all calls in one MULTI/EXEC).
CREATE_CHUNK = 2048
# Instance and sampling records a store keeps after its claims read them (they never
# change), and how many of the newest it names to each claim as known (not read again): a
# prompt's n samples share one instance, a request's jobs one sampling record. A record
# larger than RECORD_KEPT_BYTES is read by every claim (at most 16 MiB kept per store).
RECORDS_KEPT = 64
RECORDS_NAMED = 8
RECORD_KEPT_BYTES = 256 * 1024
# On a Sentinel service, milliseconds a submission or a page of results waits for a replica
# to hold it (store.replicated) before it is answered anyway.
REPLICA_WAIT_MS = 1000


def _read_counts(pipe, batch_id: str):
    """Queue the read of a batch's per-state counts (in ALL_STATES order) on ``pipe``."""
    return counters.read(pipe, keys.batch_counts(batch_id), len(ALL_STATES))


def connect(settings: Settings, max_connections: int = 64) -> redis.Redis:
    """A Redis client for a process with many threads: callers wait for a free connection
    (never fail for want of one), and commands that lose their connection are retried for
    ``redis_failover_s`` (a Sentinel failover; a single server briefly: redisconn.py). The
    socket timeout lies above the longest blocking read the farm makes (``max_wait_s``)."""
    if not settings.redis_url:
        raise ConfigError("PRORL_REDIS_URL is not set")
    return redisconn.client(
        settings.redis_url, failover_s=settings.redis_failover_s, blocking=True,
        max_connections=max_connections, decode_responses=True, health_check_interval=30,
        socket_timeout=settings.max_wait_s + SOCKET_SLACK_S, socket_connect_timeout=10)


def new_id() -> str:
    """128 random bits as 32 hex digits (the format of ``uuid4().hex``, at a fifth of the
    cost: a submission makes two per job)."""
    return os.urandom(16).hex()


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
        self.lua = Scripts(client)
        # Instance and sampling records by id, newest last (see RECORDS_KEPT).
        self._records: OrderedDict[str, str] = OrderedDict()
        self._records_lock = threading.Lock()
        self._replicated = bool(settings.redis_url) and redisconn.parse(settings.redis_url).ha

    @classmethod
    def from_settings(cls, settings: Settings, max_connections: int = 64) -> JobStore:
        return cls(connect(settings, max_connections), settings)

    def replicated(self) -> int | None:
        """On a Sentinel service, wait (up to REPLICA_WAIT_MS) until every write made so far,
        by any client, has reached a replica: what the caller says next (a 202, a page of
        results) then survives a failover. Replication is one ordered stream, so a write of
        this connection's after them, acknowledged by a replica (``WAIT``), covers them
        all. The replicas that acknowledged it (0: none did in time; the caller goes on,
        logged), or None on a single server."""
        if not self._replicated:
            return None
        pipe = self.r.pipeline(transaction=False)
        pipe.incr(keys.REPLICATED)
        pipe.execute_command("WAIT", 1, REPLICA_WAIT_MS)
        acked = int(pipe.execute()[1])
        if acked < 1:
            log.warning("no replica acknowledged the farm's writes within %d ms",
                        REPLICA_WAIT_MS)
        return acked

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
        mode: str = "policy",
        idempotency: tuple[str, str] | None = None,
        messages: StageMessages | None = None,
        tenant: str = "default",
        priority: int = 0,
    ) -> list[NewJob]:
        """Write every job of one request atomically (MULTI/EXEC), all waiting for INIT,
        with their INIT messages (``messages``) pushed and recorded on the queue in the same
        transaction: all of it lands, or none. Without ``messages`` the caller publishes
        and then calls :meth:`handed_off`.

        Each instance is stored once and shared by its ``n`` samples. ``idempotency`` (key,
        digest): the key's record, reserved by :meth:`reserve_idempotency`, gets the jobs in
        the same transaction. The batch belongs to ``tenant`` (its first submit says;
        the API refuses a later one for another tenant), whose usage counts the jobs, and
        in whose pens the jobs wait for their slots with a head start of ``priority``
        times the aging time (lua/lib/fair.lua)."""
        now = self.server_time()
        deadline_at = f"{now + deadline_s:.6f}" if deadline_s else ""
        pipe = self.r.pipeline(transaction=True)
        # Until its jobs finish (finish() extends it), an instance lives twice the result TTL.
        instance_ttl = 2 * self._ttl + int(deadline_s or 0)
        sampling_id = new_id()
        pipe.set(keys.sampling(sampling_id), json.dumps(sampling), ex=instance_ttl)
        jobs, rows = self._job_rows(pipe, instances, n, messages, instance_ttl)
        for i in range(0, len(rows), 6 * CREATE_CHUNK):  # bounded script calls, one MULTI
            self.lua("create_jobs", client=pipe, batch=batch_id, handler=handler,
                     sampling_id=sampling_id, deadline_at=deadline_at, mode=mode,
                     created_at=f"{now:.6f}", tenant=tenant,
                     prio_s=f"{priority * self.settings.fair_aging_s:.6f}", first=i // 6,
                     jobs=rows[i:i + 6 * CREATE_CHUNK])
        self._count_in(pipe, batch_id, handler, tenant, priority, now,
                       [j.job_id for j in jobs], idempotency)
        pipe.execute()
        self.replicated()  # the 202 promises jobs a failover cannot take back
        return jobs

    @staticmethod
    def _job_rows(pipe, instances: Sequence[dict], n: int, messages: StageMessages | None,
                  ttl: int) -> tuple[list[NewJob], list]:
        """Each instance stored once (on ``pipe``), and the rows of its ``n`` jobs for the
        create script: id, token, instance, index, sample, INIT message."""
        jobs: list[NewJob] = []
        rows: list = []
        for index, instance in enumerate(instances):
            instance_id = new_id()
            pipe.set(keys.instance(instance_id), json.dumps(instance), ex=ttl)
            for sample in range(n):
                job = NewJob(new_id(), new_id())
                jobs.append(job)
                message = (messages.payload("init", "init", job.job_id, job.token)
                           if messages is not None else "")
                rows += [job.job_id, job.token, instance_id, index, sample, message]
        return jobs, rows

    def _count_in(self, pipe, batch_id: str, handler: str, tenant: str, priority: int,
                  now: float, ids: list[str], idempotency: tuple[str, str] | None) -> None:
        """The batch's record, its tenant's and the farm's counts of the new jobs ``ids``,
        and the idempotency key's record, on ``pipe``."""
        pipe.hsetnx(keys.batch(batch_id), "created_at", f"{now:.6f}")
        pipe.hsetnx(keys.batch(batch_id), "handler", handler)
        pipe.hsetnx(keys.batch(batch_id), "tenant", tenant)
        pipe.hset(keys.batch(batch_id), "priority", priority)
        pipe.hincrby(keys.tenant(tenant), JobState.QUEUED.value, len(ids))
        pipe.sadd(keys.TENANTS, tenant)
        pipe.hincrby(keys.batch(batch_id), "total", len(ids))
        counters.incr(pipe, keys.batch_counts(batch_id), {STATE_SLOT["queued"]: len(ids)})
        # Jobs not yet ended: the batch's keys expire after the last one ends (lua/lib/jobs.lua).
        pipe.hincrby(keys.batch(batch_id), "left", len(ids))
        for k in (keys.batch(batch_id), keys.batch_counts(batch_id),
                  keys.batch_stream(batch_id), keys.batch_jobs(batch_id)):
            pipe.persist(k)
        pipe.hincrby(keys.STATE_COUNTS, JobState.QUEUED.value, len(ids))
        pipe.rpush(keys.batch_jobs(batch_id), *ids)
        pipe.zadd(keys.BATCHES, {batch_id: now}, nx=True)
        pipe.sadd(keys.QUEUES, "init")
        if idempotency:
            key, digest = idempotency
            pipe.set(keys.idempotency(key), json.dumps(
                {"digest": digest, "batch_id": batch_id, "job_ids": ids}), ex=self._ttl)

    def reserve_idempotency(self, key: str, digest: str, wait_s: float = 10.0) -> dict | None:
        """Reserve ``key`` for a submission with body ``digest``: None if it is ours now;
        else the earlier submission's record ({digest, batch_id, job_ids}), waiting up to
        ``wait_s`` while that one is still being written."""
        end = time.monotonic() + wait_s
        pending = json.dumps({"digest": digest, "pending": True})
        while True:
            if self.r.set(keys.idempotency(key), pending, nx=True, ex=60):
                return None
            raw = self.r.get(keys.idempotency(key))
            if raw is None:
                continue  # the earlier one failed and let go: try again
            record = json.loads(raw)
            if not record.get("pending") or record["digest"] != digest \
                    or time.monotonic() >= end:
                return record
            time.sleep(0.05)

    def forget_idempotency(self, key: str) -> None:
        """Let go of a key whose submission failed (a retry may create the jobs)."""
        self.r.delete(keys.idempotency(key))

    # -- stage transitions ----------------------------------------------------------------

    def claim(self, job_id: str, stage: str, token: str, worker: str, holder: str = ""
              ) -> tuple[Claim, dict]:
        """Claim ``stage`` of a job for ``worker`` (in the process whose presence name is
        ``holder``): (OK, job fields with its ``instance`` JSON) or (the reason, {})."""
        with self._records_lock:
            known = dict(islice(reversed(self._records.items()), RECORDS_NAMED))
        out = self.lua("claim", job=job_id, stage=stage, token=token, worker=worker,
                       ttl_s=self._ttl, holder=holder, known=list(known))
        if out[0] != Claim.OK.value:
            return Claim(out[0]), {}
        names = CLAIM_FIELDS + (f"t_{stage}_start",)
        raw = {k: v for k, v in zip(names, out[1]) if v is not None}
        raw["instance"] = self._record(out[4], out[2], known)
        raw["sampling"] = self._record(out[5], out[3], known)
        return Claim.OK, raw

    def _record(self, record_id: str | None, value: str | None, known: dict[str, str]
                ) -> str | None:
        """An instance or sampling record a claim returned (``value``) or left out because
        the caller named it as known; kept for the claims that follow."""
        if not record_id:
            return None
        if value is None:
            value = known.get(record_id)
            if value is None:
                return None  # no longer stored
        if len(value) > RECORD_KEPT_BYTES:
            return value
        with self._records_lock:
            self._records[record_id] = value
            self._records.move_to_end(record_id)
            while len(self._records) > RECORDS_KEPT:
                self._records.popitem(last=False)
        return value

    def advance(self, job_id: str, from_stage: str, token: str, to_stage: str, queue: str,
                node: str, field: str, value: str, messages: StageMessages | None = None
                ) -> str | None:
        """Move a job to the next stage's queue; returns its new token, or None if stale.
        With ``messages``, the next stage's message is pushed (and recorded) in the same
        script; without, the caller publishes it and then calls :meth:`handed_off`."""
        new_token = new_id()
        message = (messages.payload(to_stage, queue, job_id, new_token)
                   if messages is not None else "")
        out = self.lua("advance", job=job_id, from_stage=from_stage, token=token,
                       to_stage=to_stage, new_token=new_token, queue=queue, node=node,
                       field=field, value=value, message=message)
        return new_token if out == "ok" else None

    def handed_off(self, pairs: Iterable[tuple[str, str]]) -> None:
        """The messages for these (job, new token) pairs are published: record it, and stop
        heartbeating them."""
        flat = [x for pair in pairs for x in pair]
        for i in range(0, len(flat), 2 * HANDED_OFF_CHUNK):
            self.lua("handed_off", pairs=flat[i:i + 2 * HANDED_OFF_CHUNK])

    def finish(self, job_id: str, state: JobState, kind: str = "", message: str = "",
               token: str = "", fields: dict | None = None) -> Finished:
        """Put a job in a terminal state (once); with ``token``, only from that active attempt."""
        flat: list = []
        for k, v in (fields or {}).items():
            flat += [k, v]
        out = self.lua("finish", job=job_id, token=token, state=state.value, kind=kind,
                       message=message[:4000], ttl_s=self._ttl, fields=flat)
        if not out.startswith("ok:"):
            return Finished(False, old_state=out.partition(":")[2])
        _, old_state, old_phase, old_token = out.split(":", 3)
        return Finished(True, old_state, old_phase, old_token)

    def heartbeat(self, held: Iterable[tuple[str, str]], holder: str = ""
                  ) -> list[tuple[str, str]]:
        """Refresh heartbeats of (job, token) pairs held by the process named ``holder``;
        return the pairs to abort."""
        flat = [x for pair in held for x in pair]
        if not flat:
            return []
        out = self.lua("heartbeat", holder=holder, pairs=flat)
        return list(zip(out[::2], out[1::2]))

    def reap(self, job_id: str, mode: str, cutoff: float, expect_token: str, queue: str,
             message: str, messages: StageMessages | None = None) -> tuple[Reap, str]:
        """Recover one job whose worker is dead, if it still carries ``expect_token``;
        returns (outcome, new token if re-queued). See lua/reap.lua for the modes. With
        ``messages``, a re-queued job's INIT message is pushed in the same script; without,
        the caller publishes it and then calls :meth:`handed_off`."""
        token = new_id()
        init = messages.payload("init", "init", job_id, token) if messages is not None else ""
        out = self.lua("reap", job=job_id, mode=mode, cutoff=cutoff, expect_token=expect_token,
                       queue=queue, max_requeues=self.settings.max_requeues, new_token=token,
                       ttl_s=self._ttl, reason=message, max_history=MAX_ATTEMPT_HISTORY,
                       message=init)
        return Reap(out), token

    def tokens(self, job_ids: Sequence[str]) -> list[str | None]:
        return [row[0] for row in self.job_fields(job_ids, "token")]

    def job_fields(self, job_ids: Sequence[str], *names: str) -> list[list[str | None]]:
        """The named fields of each job (None where missing), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), *names)
        return pipe.execute()

    def try_lock(self, key: str, value: str, ttl_s: float) -> bool:
        return bool(self.r.set(key, value, nx=True, px=max(1, int(ttl_s * 1000))))

    def expire_deadlines(self, limit: int = 1000, grace_s: float = 0.0) -> int:
        """Fail jobs past their deadline; running ones only ``grace_s`` after it."""
        return int(self.lua("expire_deadlines", ttl_s=self._ttl, limit=limit, grace_s=grace_s))

    # -- reads ----------------------------------------------------------------------------

    def get_raw(self, job_id: str) -> dict:
        """The job's hash with its ``sampling`` and ``instance`` JSON."""
        raw = self.r.hgetall(keys.job(job_id))
        if not raw:
            raise NotFound(f"job {job_id!r} not found")
        raw["sampling"], raw["instance"] = self.r.mget(
            keys.sampling(raw.get("sampling_id", "")), keys.instance(raw.get("instance_id", "")))
        return raw

    def state_of(self, job_id: str) -> str | None:
        """The job's state, or None when it does not exist (any more)."""
        return self.r.hget(keys.job(job_id), "state")

    def get_many_raw(self, job_ids: Sequence[str]) -> list[dict]:
        """Job hashes (``{}`` for one that is gone), each with its ``sampling`` JSON."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        raws = pipe.execute()
        ids = sorted({raw["sampling_id"] for raw in raws if raw.get("sampling_id")})
        if ids:  # a request's jobs share one: usually one read for the page
            of = dict(zip(ids, self.r.mget([keys.sampling(i) for i in ids])))
            for raw in raws:
                if raw.get("sampling_id"):
                    raw["sampling"] = of[raw["sampling_id"]]
        return raws

    def batch_summary(self, batch_id: str) -> dict:
        pipe = self.r.pipeline(transaction=True)
        pipe.hgetall(keys.batch(batch_id))
        _read_counts(pipe, batch_id)
        meta, counts = pipe.execute()
        if not meta:
            raise NotFound(f"batch {batch_id!r} not found")
        return self._summary(batch_id, meta, counts)

    def recent_batches(self, limit: int, tenants: frozenset[str] | None = None
                       ) -> list[dict]:
        """The newest batches (by creation) still stored, with their counts; with
        ``tenants``, only those of these tenants (read a page of the index at a time)."""
        out: list[dict] = []
        start, page = 0, limit if tenants is None else max(limit, 256)
        while len(out) < limit:
            ids = self.r.zrevrange(keys.BATCHES, start, start + page - 1)
            if not ids:
                break
            start += page
            pipe = self.r.pipeline(transaction=False)
            for batch_id in ids:
                pipe.hgetall(keys.batch(batch_id))
                _read_counts(pipe, batch_id)
            rows = pipe.execute()
            gone = []
            for i, batch_id in enumerate(ids):
                meta, counts = rows[2 * i], rows[2 * i + 1]
                if not meta:
                    gone.append(batch_id)  # expired: drop it from the index
                elif tenants is None or batch_tenant(batch_id) in tenants:
                    out.append(self._summary(batch_id, meta, counts))
            if gone:
                self.r.zrem(keys.BATCHES, *gone)
                start -= len(gone)
            if tenants is None:
                break
        return out[:limit]

    @staticmethod
    def _summary(batch_id: str, meta: dict, counts: list[int]) -> dict:
        counts = dict(zip(ALL_STATES, map(int, counts)))
        terminal = counts["done"] + counts["failed"] + counts["cancelled"]
        return {
            "batch_id": batch_id,
            "total": int(meta.get("total", 0)),
            "counts": counts,
            "finished": terminal,
            "complete": terminal == int(meta.get("total", 0)),
            "created_at": float(meta.get("created_at", 0)),
            "handler": meta.get("handler"),
            "tenant": batch_tenant(batch_id),
            "priority": int(meta.get("priority", 0)),
        }

    def batch_job_ids(self, batch_id: str) -> list[str]:
        return self.r.lrange(keys.batch_jobs(batch_id), 0, -1)

    def batch_results(self, batch_id: str, cursor: str, limit: int, wait_s: float
                      ) -> tuple[list[dict], str]:
        """Finished jobs after ``cursor`` in the order they finished; blocks up to ``wait_s``
        (at most ``max_wait_s``) while there are none, unless the batch is complete."""
        page = self.many_batch_results({batch_id: cursor}, limit, wait_s)[batch_id]
        if page is None:
            raise NotFound(f"batch {batch_id!r} not found")
        return page["results"], page["cursor"]

    def many_batch_results(self, cursors: dict[str, str], limit: int, wait_s: float
                           ) -> dict[str, dict]:
        """:meth:`batch_results` for several batches in one read (a trainer polling
        hundreds of prompt groups makes one request, not hundreds): {batch: {results (raw
        jobs), cursor, summary}}, or {batch: None} for a batch that is not (or no longer)
        stored. Blocks up to ``wait_s`` while none of the incomplete ones has a result."""
        ids = list(cursors)
        pipe = self.r.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(keys.batch(batch_id))
            _read_counts(pipe, batch_id)
        rows = pipe.execute()
        summaries = {b: self._summary(b, rows[2 * i], rows[2 * i + 1])
                     for i, b in enumerate(ids) if rows[2 * i]}
        streams = {keys.batch_stream(b): cursors[b] for b in summaries}
        got = self.r.xread(streams, count=limit) if streams else []
        waiting = {keys.batch_stream(b): cursors[b] for b, s in summaries.items()
                   if not s["complete"]}
        wait_s = min(wait_s, self.settings.max_wait_s)
        if not got and waiting and wait_s > 0:
            got = self.r.xread(waiting, count=limit, block=max(1, int(wait_s * 1000)))
        of_stream = {keys.batch_stream(b): b for b in summaries}
        entries = {of_stream[stream]: items for stream, items in got or []}
        raws = iter(self.get_many_raw([f["job"] for items in entries.values()
                                       for _, f in items]))
        out: dict[str, dict | None] = dict.fromkeys(ids)
        for batch_id, summary in summaries.items():
            items = entries.get(batch_id, [])
            jobs = [next(raws) for _ in items]
            out[batch_id] = {"results": [j for j in jobs if j], "summary": summary,
                             "cursor": items[-1][0] if items else cursors[batch_id]}
        if entries:
            self.replicated()  # a result read is one a failover cannot take back
        return out

    # -- the trajectory store's accounting -----------------------------------------------

    def note_payload(self, batch_id: str, nbytes: int) -> None:
        """A payload of ``nbytes`` was written for the batch (and counts for its tenant)."""
        tenant = batch_tenant(batch_id)  # in its id: no record read can say otherwise
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(keys.tenant(tenant), "store_bytes", nbytes)
        pipe.hsetnx(keys.PAYLOAD_TENANTS, batch_id, tenant)
        pipe.hincrby(keys.PAYLOAD_STATS, "bytes", nbytes)
        pipe.hincrby(keys.PAYLOAD_STATS, "files", 1)
        pipe.zadd(keys.PAYLOAD_BATCHES, {batch_id: self.server_time()}, nx=True)
        pipe.execute()

    def payloads_gone(self, batch_id: str, files: int, nbytes: int, acked: bool) -> None:
        """The batch's payloads were deleted (``acked``: the trainer acknowledged it)."""
        tenant = self.r.hget(keys.PAYLOAD_TENANTS, batch_id)
        pipe = self.r.pipeline(transaction=True)
        if tenant:
            pipe.hincrby(keys.tenant(tenant), "store_bytes", -nbytes)
            pipe.hdel(keys.PAYLOAD_TENANTS, batch_id)
        pipe.hincrby(keys.PAYLOAD_STATS, "bytes", -nbytes)
        pipe.hincrby(keys.PAYLOAD_STATS, "files", -files)
        pipe.zrem(keys.PAYLOAD_BATCHES, batch_id)
        if acked:
            pipe.hset(keys.batch(batch_id), "acked_at", repr(self.server_time()))
        pipe.execute()

    def payload_stats(self) -> dict:
        """What the trajectory store holds: bytes, files, batches not acknowledged, and
        the oldest of them (its id and when its first payload was written)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.PAYLOAD_STATS)
        pipe.zcard(keys.PAYLOAD_BATCHES)
        pipe.zrange(keys.PAYLOAD_BATCHES, 0, 0, withscores=True)
        stats, count, oldest = pipe.execute()
        return {"bytes": max(0, int(stats.get("bytes", 0))),
                "files": max(0, int(stats.get("files", 0))),
                "unacked_batches": count,
                "oldest_unacked": ({"batch_id": oldest[0][0], "since": oldest[0][1]}
                                   if oldest else None)}

    # -- pools ----------------------------------------------------------------------------

    def server_time(self) -> float:
        """Redis's clock (epoch seconds): the one clock every node's timings agree on."""
        secs, micros = self.r.time()
        return secs + micros / 1e6

    def fair_fill(self, queue: str, pool: str, shared: int, reserve: int, ttl_s: float,
                  weights: dict[str, float], limit: int = 10_000) -> int:
        """Register (or with 0 and 0, withdraw) the slots pool process ``pool`` takes of
        ``queue``, write the tenants' weights, and hand free slots to waiting jobs; returns
        how many got one (lua/fair_fill.lua)."""
        flat = [x for name, w in sorted(weights.items()) for x in (name, repr(float(w)))]
        return int(self.lua("fair_fill", slots=keys.slots(queue), held=keys.held(queue),
                            pens=keys.pen_flows(queue), weights=keys.WEIGHTS, queue=queue,
                            pool=pool, shared=shared, reserve=reserve, ttl_s=ttl_s,
                            limit=limit, tenant_weights=flat))

    def leave_sweep(self, queue: str, mark: bool = True, limit: int = 100_000
                    ) -> list[tuple[str, str]]:
        """(job, token) of every job waiting on ``queue``, its list and its pens read in one
        step; ``mark``: the queue is marked left, in the same step (lua/leave_sweep.lua)."""
        flat = self.lua("leave_sweep", queue=queue, mark=int(mark), limit=limit)
        return list(zip(flat[::2], flat[1::2]))

    def waiting_in_pens(self, queue: str, before: float = float("inf"), limit: int = 100_000
                        ) -> list[str]:
        """Jobs waiting in ``queue``'s pens for a slot, placed before ``before`` (epoch s;
        a place is in microseconds)."""
        out: list[str] = []
        bound = f"({before * 1e6:.0f}" if before != float("inf") else "+inf"
        for flow in sorted(self.r.smembers(keys.pen_flows(queue))):
            out += self.r.zrangebyscore(keys.pen(queue, flow), "-inf", bound,
                                        start=0, num=limit)
        return out[:limit]

    def pool_beat(self, stage: str, node: str) -> None:
        self.r.zadd(keys.POOLS, {f"{stage}:{node}": self.server_time()})

    def live_pools(self, max_age_s: float) -> dict[str, float]:
        """Pools ("<stage>:<node>") that heartbeat within ``max_age_s``, with their age."""
        now = self.server_time()
        rows = self.r.zrangebyscore(keys.POOLS, now - max_age_s, "+inf", withscores=True)
        return {member: round(now - score, 3) for member, score in rows}
