"""Warm sandboxes: a READY stage between a job's wait for INIT and its INIT.

A node's INIT pool keeps up to ``PRORL_WARM_POOL`` sandboxes ready for the jobs about to
reach INIT there: the next jobs waiting for INIT (in the pens and on the queue,
``PRORL_WARM_SCAN`` of them) are grouped by their *INIT key* (handler and instance: the
samples of one instance, or the same instance submitted again, share one), and for each key
with more jobs waiting than warm sandboxes, builders run the handler's own INIT for it, as
the job's INIT would (the filesystem written, the tool server started, the setup run), but
for a warm handle ("warm-<id>") instead of a job. A job's INIT then takes a ready sandbox of
its key (lua/warm_take.lua) and adopts it (its record, index and tenant's count move to the
job, lua/sandbox_adopt.lua) instead of building one: milliseconds instead of seconds.

A warm sandbox serves one job, once: it is the job's from then on, and stopped with it like
any sandbox of the job; nothing of it is handed on. One left unused past
``PRORL_WARM_TTL_S`` is stopped (by the warmer, or by the node's janitor if its warmer
died). Only handlers whose INIT does nothing but make the job's sandboxes from its instance
say ``warmable``; a reference-mode job (no sandbox) never takes one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from prorl_farm import keys
from prorl_farm.context import JobContext
from prorl_farm.sandbox.manager import WARM_PREFIX

log = logging.getLogger(__name__)

FILL_EVERY_S = 0.5


def init_key(tenant: str, handler: str, instance: dict) -> str:
    """The INIT key of a job: what its INIT makes depends on its handler and instance only,
    and the key holds its tenant too, so that a tenant's jobs take only sandboxes built for
    its own (one tenant's warm hit would tell another that the same instance waits in its
    queue)."""
    raw = json.dumps([tenant, handler, instance], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


class WarmPool:
    """The READY stage of one INIT pool process (its node's warm sandboxes)."""

    def __init__(self, store, settings, registry, sandboxes):
        self.store, self.r = store, store.r
        self.settings = settings
        self.registry = registry
        self.sandboxes = sandboxes
        self.node = settings.node
        self.size = settings.warm_pool
        self.ttl_s = settings.warm_ttl_s
        self._builders = ThreadPoolExecutor(max(1, settings.warm_builders),
                                            thread_name_prefix="warm-build")
        self._mine: set[str] = set()  # handles this process built (stopped at close)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the job's side ---------------------------------------------------------------

    def take(self, handler_name: str, ctx: JobContext) -> dict | None:
        """A ready sandbox of the job's INIT key, adopted by the job: its INIT state; None
        (a miss) if none is ready."""
        key = init_key(ctx.tenant, handler_name, ctx.instance)
        got = self.store.lua("warm_take", ready=keys.warm_ready(self.node, key),
                             records=keys.warm(self.node), stats=keys.WARM_STATS,
                             node=self.node, now=time.time())
        if not got:
            return None
        handle, raw = got
        with self._lock:
            self._mine.discard(handle)
        state = json.loads(raw)["state"]
        box = self.sandboxes.adopt(state["sandbox"], ctx.job_id, ctx.requeues)
        if box is None:
            return None
        state = {**state, "sandbox": box.to_dict()}
        ctx.state = state
        log.info("INIT: warm sandbox %s taken (key %s)", box.id, key[:8])
        return state

    # -- the builders' side -----------------------------------------------------------

    def start(self) -> None:
        if self.size > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="warm", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(FILL_EVERY_S):
            try:
                self.fill()
            except Exception:
                log.warning("warm pool: fill failed", exc_info=True)

    def demand(self) -> dict[str, tuple[str, dict, int]]:
        """INIT key -> (handler, instance, jobs waiting) of the next jobs waiting for INIT
        whose handler is warmable (policy mode)."""
        scan = self.settings.warm_scan
        # With fair share the jobs on the queue hold INIT slots (their INIT is starting): the
        # ones to build for wait in the pens. Without, every waiting job is on the queue.
        if self.settings.fair_share:
            waiting = self.store.waiting_in_pens("init", limit=scan)
        else:
            waiting = self.r.zrange(keys.queued("init"), 0, scan - 1)
        if not waiting:
            return {}
        rows = self.store.job_fields(waiting[:scan], "handler", "instance_id", "mode",
                                     "tenant")
        by_instance: Counter[tuple[str, str, str]] = Counter()
        for handler, instance_id, mode, tenant in rows:
            if handler and instance_id and (mode or "policy") == "policy" and \
                    self._warmable(handler):
                by_instance[(tenant or "default", handler, instance_id)] += 1
        if not by_instance:
            return {}
        ids = sorted({i for _, _, i in by_instance})
        texts = dict(zip(ids, self.r.mget([keys.instance(i) for i in ids])))
        out: dict[str, tuple[str, dict, int]] = {}
        for (tenant, handler, instance_id), n in by_instance.items():
            if texts.get(instance_id) is None:
                continue
            instance = json.loads(texts[instance_id])
            key = init_key(tenant, handler, instance)
            prev = out.get(key)
            out[key] = (handler, instance, n + (prev[2] if prev else 0))
        return out

    def _warmable(self, handler: str) -> bool:
        try:
            return bool(getattr(self.registry.get(handler), "warmable", False))
        except Exception:  # a handler this pool does not know
            return False

    def fill(self) -> int:
        """Stop warm sandboxes past their time; start builds for the keys with more jobs
        waiting than sandboxes ready or being built, most wanted first, up to the pool's
        size on this node. Returns the builds started."""
        self._expire()
        wanted = self.demand()
        if not wanted:
            return 0
        records = self.r.hvals(keys.warm(self.node))
        have = Counter(json.loads(v)["key"] for v in records)
        room = self.size - len(records)
        started = 0
        for key, (handler, instance, n) in sorted(wanted.items(), key=lambda kv: -kv[1][2]):
            short = n - have[key]  # the records count those being built too
            while short > 0 and room > 0:
                self._launch(key, handler, instance)
                short -= 1
                room -= 1
                started += 1
        return started

    def _launch(self, key: str, handler: str, instance: dict) -> None:
        handle = f"{WARM_PREFIX}{uuid.uuid4().hex[:16]}"
        self.r.hset(keys.warm(self.node), handle, json.dumps(
            {"key": key, "status": "building", "until": time.time() + self.ttl_s}))
        with self._lock:
            self._mine.add(handle)
        self._builders.submit(self._build, handle, key, handler, instance)

    def _build(self, handle: str, key: str, handler_name: str, instance: dict) -> None:
        ctx = JobContext(job_id=handle, batch_id="", stage="init", token="", node=self.node,
                         instance=instance, sampling={},
                         deadline_monotonic=time.monotonic() + self.settings.init.timeout_s,
                         sandboxes=self.sandboxes, settings=self.settings)
        t0 = time.monotonic()
        try:
            state = self.registry.get(handler_name).init(ctx)
            if self._stop.is_set() or not state.get("sandbox"):
                raise RuntimeError("stopping" if self._stop.is_set() else "no sandbox made")
            record = {"key": key, "status": "ready", "until": time.time() + self.ttl_s,
                      "state": state, "build_s": round(time.monotonic() - t0, 3)}
            pipe = self.r.pipeline()
            pipe.hset(keys.warm(self.node), handle, json.dumps(record))
            pipe.lpush(keys.warm_ready(self.node, key), handle)
            pipe.expire(keys.warm_ready(self.node, key), int(self.ttl_s) + 60)
            pipe.hincrby(keys.WARM_STATS, f"{self.node}:built", 1)
            pipe.execute()
        except Exception as e:
            log.warning("warm pool: building for key %s failed: %s", key[:8], e)
            self.r.hdel(keys.warm(self.node), handle)
            self.sandboxes.stop_for_job(handle)
            with self._lock:
                self._mine.discard(handle)

    def _expire(self) -> None:
        """Ready sandboxes past their time, and records nobody builds any more, go."""
        now = time.time()
        for handle, raw in self.r.hgetall(keys.warm(self.node)).items():
            rec = json.loads(raw)
            if rec["until"] >= now:
                continue
            if self.r.hdel(keys.warm(self.node), handle):
                self.sandboxes.stop_for_job(handle)
                self.r.hincrby(keys.WARM_STATS, f"{self.node}:expired", 1)
                with self._lock:
                    self._mine.discard(handle)

    def close(self) -> None:
        """Stop building; stop this process's warm sandboxes (ready or being built)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._builders.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            mine = sorted(self._mine)
            self._mine.clear()
        for handle in mine:
            self.r.hdel(keys.warm(self.node), handle)
            self.sandboxes.stop_for_job(handle)
