"""Farm-wide metrics, kept in Redis so that every process (API workers, pools on every
node) adds to the same series and any API process can serve them.

Histograms are counter arrays (counters.py) of fixed buckets (slots 0..N-1 not cumulative,
slot N for +Inf) and their sum in microseconds (SUM_SLOT), observed inside the job scripts
(one BITFIELD, no extra round trip) or, for the API's request latency, flushed from each
process about once a second.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import redis

from prorl_farm import counters, keys

# Seconds: queue waits and stage times span milliseconds (no-op stages) to an hour (a SWE
# agent's RUN).
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
             30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
# A histogram's counter array: the buckets (+Inf last), then the sum in microseconds.
SUM_SLOT = len(BUCKETS_S) + 1
HIST_SLOTS = SUM_SLOT + 1
# The dashboard's history (prorl_farm/history.py): a hash of counters per minute, kept a
# day and an hour (the Lua scripts count into it as jobs are claimed and end).
HISTORY_STEP_S = 60
HISTORY_TTL_S = 25 * 3600


def bucket_index(value: float) -> int:
    """1-based bucket of ``value`` (len(BUCKETS_S) + 1 for +Inf), as lua/lib/metrics.lua
    picks it."""
    for i, bound in enumerate(BUCKETS_S, 1):
        if value <= bound:
            return i
    return len(BUCKETS_S) + 1


def read_histogram(raw: list[int]) -> tuple[list[tuple[str, float]], float]:
    """A histogram's counters (histogram_read) -> (cumulative buckets as prometheus_client
    wants them, sum in seconds)."""
    out, total = [], 0
    for i, bound in enumerate((*BUCKETS_S, float("inf"))):
        total += int(raw[i])
        out.append(("+Inf" if bound == float("inf") else repr(bound), total))
    return out, int(raw[SUM_SLOT]) / 1e6


def histogram_read(client, name: str):
    """Queue the read of histogram ``name``'s counters on ``client`` (or a pipeline)."""
    return counters.read(client, keys.histogram(name), HIST_SLOTS)


class LatencyRecorder:
    """Request latency by route, observed in process and added to Redis at most once per
    ``flush_s`` (one pipelined round trip for everything seen since)."""

    def __init__(self, r: redis.Redis, flush_s: float = 1.0):
        self.r, self.flush_s = r, flush_s
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, float]] = {}
        self._last = time.monotonic()

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            h = self._pending.setdefault(name, {})
            b = bucket_index(seconds) - 1
            h[b] = h.get(b, 0) + 1
            h[SUM_SLOT] = h.get(SUM_SLOT, 0) + round(seconds * 1e6)
            if time.monotonic() - self._last < self.flush_s:
                return
            pending, self._pending, self._last = self._pending, {}, time.monotonic()
        self._flush(pending)

    def _flush(self, pending: dict) -> None:
        try:
            pipe = self.r.pipeline(transaction=False)
            pipe.sadd(keys.API_ROUTES, *pending)
            for name, h in pending.items():
                counters.incr(pipe, keys.histogram(name), h)
            pipe.execute()
        except redis.RedisError:
            pass  # metrics never fail a request


@dataclass
class FarmCounters:
    """What /metrics and the dashboard read, in one pipelined round trip (after the sets
    that name the queues, nodes and API routes)."""

    queues: dict[str, tuple[int, float | None]]  # queue -> (depth, oldest enqueue time)
    held: int  # jobs held by a live worker
    live: dict[str, int]  # node -> live sandboxes
    started: dict  # node -> sandboxes started
    states: dict
    stats: dict
    failures: dict
    reaper: dict
    hists: dict[str, list]  # "wait:<stage>" / "active:<stage>" -> histogram counters
    api: dict[str, list]  # "api:<method>:<route>" -> histogram counters


def _depth(r: redis.Redis, queue: str, listed: int, head: list, pen_flows: set
           ) -> tuple[int, float | None]:
    """A queue's jobs waiting (on its list, and in its flows' pens for a slot) and when
    the oldest came (a pen's place is in microseconds, less a priority's head start)."""
    oldest = head[0][1] if head else None
    if pen_flows:
        pipe = r.pipeline(transaction=False)
        for flow in sorted(pen_flows):
            pipe.zcard(keys.pen(queue, flow))
            pipe.zrange(keys.pen(queue, flow), 0, 0, withscores=True)
        got = pipe.execute()
        listed += sum(got[0::2])
        firsts = [rows[0][1] / 1e6 for rows in got[1::2] if rows]
        if firsts:
            oldest = min([oldest, *firsts]) if oldest is not None else min(firsts)
    return listed, oldest


def read_counters(r: redis.Redis, api: bool = True) -> FarmCounters:
    from prorl_farm.config import STAGES
    from prorl_farm.states import TERMINAL_STATES

    queues = sorted(r.smembers(keys.QUEUES))
    nodes = sorted(r.smembers(keys.SANDBOX_NODES))
    hist_names = [f"{kind}:{stage}" for kind in ("wait", "active") for stage in STAGES]
    api_names = sorted(r.smembers(keys.API_ROUTES)) if api else []
    pipe = r.pipeline(transaction=False)
    for name in (keys.STATE_COUNTS, keys.FAILURE_KINDS, keys.REAPER_ACTIONS,
                 keys.SANDBOXES_STARTED):
        pipe.hgetall(name)
    for q in queues:
        pipe.zcard(keys.queued(q))
        pipe.zrange(keys.queued(q), 0, 0, withscores=True)
        pipe.smembers(keys.pen_flows(q))
    pipe.zcard(keys.ACTIVE)
    for node in nodes:
        pipe.hlen(keys.sandbox_slots(node))
    for name in hist_names + api_names:
        histogram_read(pipe, name)
    out = pipe.execute()
    states, failures, reaper, started = out[:4]
    out = out[4:]
    # Terminal states only count up: their counters are the farm's lifetime totals.
    stats = {s.value: states.get(s.value, 0) for s in TERMINAL_STATES}
    queue_rows = {q: _depth(r, q, out[3 * i], out[3 * i + 1], out[3 * i + 2])
                  for i, q in enumerate(queues)}
    out = out[3 * len(queues):]
    held, out = out[0], out[1:]
    live, hists = dict(zip(nodes, out[:len(nodes)])), out[len(nodes):]
    return FarmCounters(queue_rows, held, live, started, states, stats, failures, reaper,
                        dict(zip(hist_names, hists)), dict(zip(api_names,
                                                               hists[len(hist_names):])))


def _prom():
    """prometheus_client's metric families (imported where metrics are served only)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    return CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


def collect(r: redis.Redis, backends: list[dict], pools: dict[str, float],
            trajectories: dict | None = None, tenants: dict | None = None) -> list:
    """Every farm metric family (``trajectories``: overview.trajectory_store_view;
    ``tenants``: the configured tenants, prorl_farm/tenants.py)."""
    snap = read_counters(r)
    return [*_job_families(snap), *_queue_and_pool_families(snap, pools),
            *_backend_families(backends), *_sandbox_and_store_families(snap, trajectories),
            *_reaper_and_api_families(snap), *_tenant_families(r, tenants or {})]


def _job_families(snap: FarmCounters) -> list:
    """Jobs per state, finished and failed, and each stage's wait and active time."""
    from prorl_farm.config import STAGES
    from prorl_farm.states import ALL_STATES, TERMINAL_STATES

    Counter, Gauge, Histogram = _prom()
    fams = []
    g = Gauge("prorl_jobs", "Jobs now in each non-terminal state.", labels=["state"])
    terminal = {s.value for s in TERMINAL_STATES}
    for state in ALL_STATES:
        if state not in terminal:
            g.add_metric([state], max(0, int(snap.states.get(state, 0))))
    fams.append(g)
    c = Counter("prorl_jobs_finished", "Jobs that reached a terminal state.", labels=["state"])
    for state in sorted(terminal):
        c.add_metric([state], int(snap.stats.get(state, 0)))
    fams.append(c)
    c = Counter("prorl_jobs_failed", "Failed jobs by failure kind.", labels=["kind"])
    for kind, n in sorted(snap.failures.items()):
        c.add_metric([kind], int(n))
    fams.append(c)
    for kind, doc in (("wait", "Time a job waited on a stage's queue."),
                      ("active", "Time a stage ran (claim to hand-off or end).")):
        h = Histogram(f"prorl_stage_{kind}_seconds", doc, labels=["stage"])
        for stage in STAGES:
            buckets, total = read_histogram(snap.hists[f"{kind}:{stage}"])
            h.add_metric([stage], buckets, total)
        fams.append(h)
    return fams


def _queue_and_pool_families(snap: FarmCounters, pools: dict[str, float]) -> list:
    _, Gauge, _ = _prom()
    g = Gauge("prorl_queue_depth", "Jobs waiting on each queue.", labels=["queue"])
    for q, (n, _) in snap.queues.items():
        g.add_metric([q], n)
    held = Gauge("prorl_jobs_held", "Jobs held (reserved or running) by a live worker.",
                 value=snap.held)
    ages = Gauge("prorl_pool_heartbeat_age_seconds", "Age of each live pool's heartbeat.",
                 labels=["stage", "node"])
    for pool, age in sorted(pools.items()):
        stage, _, node = pool.partition(":")
        ages.add_metric([stage, node], age)
    return [g, held, ages]


# Each backend's gauges: name -> (doc, the value of a backend's view; None: not shown).
PER_BACKEND = {
    "in_flight": ("Jobs pinned to the backend now.", lambda b: b["in_flight"]),
    "capacity": ("The backend's registered capacity.", lambda b: b["capacity"]),
    "load": ("In-flight / capacity.", lambda b: b["load"]),
    "expected_delay_ms": ("Its min-heap key: the request time one more job would add there "
                          "(absent when out of the heap).", lambda b: b["expected_delay_ms"]),
    "latency_ms": ("Moving average of the backend's request latency.",
                   lambda b: b["latency_ms"]),
    "service_ms": ("Moving average of its service time (latency less queueing).",
                   lambda b: b["service_ms"]),
    "healthy": ("1 if the last probe or request succeeded.", lambda b: int(b["healthy"])),
    "drained": ("1 while drained (no new jobs).", lambda b: int(b["drained"])),
    "policy_version": ("The policy version the backend serves.",
                       lambda b: b["policy_version"]),
    "weights_mismatch": ("1 while its weights failed their check after a sync (kept out of "
                         "the heap).", lambda b: int(bool(b["weights"]["error"]))),
    "weights_max_error": ("The largest logprob error its last weight check measured.",
                          lambda b: b["weights"]["max_error"]),
    "max_model_len": ("The context length the engine serves.", lambda b: b["max_model_len"]),
}


def _backend_families(backends: list[dict]) -> list:
    Counter, Gauge, _ = _prom()
    fams = []
    for name, (doc, get) in PER_BACKEND.items():
        g = Gauge(f"prorl_backend_{name}", doc, labels=["backend", "model"])
        for b in backends:
            value = get(b)
            if value is not None:
                g.add_metric([b["id"], b["model"]], value)
        fams.append(g)
    c = Counter("prorl_backend_requests", "LLM requests sent to the backend.",
                labels=["backend", "model"])
    for b in backends:
        c.add_metric([b["id"], b["model"]], b["requests_total"])
    return [*fams, c]


STORE_GAUGES = {
    "bytes": "Bytes of trajectory payloads in the store.",
    "files": "Trajectory payloads in the store.",
    "unacked_batches": "Batches with payloads not acknowledged by the trainer.",
    "oldest_unacked_age_s": "Age of the oldest unacknowledged batch's first payload.",
    "free_bytes": "Free bytes on the trajectory store's medium.",
}


def _sandbox_and_store_families(snap: FarmCounters, trajectories: dict | None) -> list:
    Counter, Gauge, _ = _prom()
    live = Gauge("prorl_sandboxes_live", "Sandboxes running on each node.", labels=["node"])
    for node, n in snap.live.items():
        live.add_metric([node], n)
    started = Counter("prorl_sandboxes_started", "Sandboxes started on each node.",
                      labels=["node"])
    for node in snap.live:
        started.add_metric([node], int(snap.started.get(node, 0)))
    fams = [live, started]
    for name, doc in STORE_GAUGES.items():
        value = (trajectories or {}).get(name)
        if value is not None:
            metric = name.replace("_age_s", "_age_seconds")
            fams.append(Gauge(f"prorl_trajectory_store_{metric}", doc, value=value))
    return fams


def _reaper_and_api_families(snap: FarmCounters) -> list:
    Counter, _, Histogram = _prom()
    c = Counter("prorl_reaper_actions", "Reaper actions: re-queues and failures by how the job "
                "was found (active: stale heartbeat, queued: dead node's queue, orphan, lost "
                "message; deadline).", labels=["mode", "outcome"])
    for key, n in sorted(snap.reaper.items()):
        mode, _, outcome = key.partition(":")
        c.add_metric([mode, outcome], int(n))
    h = Histogram("prorl_api_request_seconds", "API request latency by route.",
                  labels=["method", "route"])
    for name, raw in snap.api.items():
        _, method, route = name.split(":", 2)
        buckets, total = read_histogram(raw)
        h.add_metric([method, route], buckets, total)
    return [c, h]


def _tenant_families(r: redis.Redis, tenants: dict) -> list:
    """Per tenant: its jobs queued and in each stage, its store bytes, its quotas."""
    from prometheus_client.core import GaugeMetricFamily

    names = sorted(set(tenants) | set(r.smembers(keys.TENANTS)))
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.tenant(name))
    raw = dict(zip(names, pipe.execute()))
    jobs = GaugeMetricFamily("prorl_tenant_jobs", "A tenant's jobs now in each non-terminal "
                             "state.", labels=["tenant", "state"])
    store = GaugeMetricFamily("prorl_tenant_store_bytes", "A tenant's bytes in the "
                              "trajectory store.", labels=["tenant"])
    boxes = GaugeMetricFamily("prorl_tenant_sandboxes", "A tenant's sandboxes live now.",
                              labels=["tenant"])
    quota = GaugeMetricFamily("prorl_tenant_quota", "A tenant's quota (absent: none).",
                              labels=["tenant", "quota"])
    for name in names:
        for state in ("queued", "init", "run", "eval"):
            jobs.add_metric([name, state], max(0, int(raw[name].get(state, 0))))
        store.add_metric([name], max(0, int(raw[name].get("store_bytes", 0))))
        boxes.add_metric([name], max(0, int(raw[name].get("sandboxes", 0))))
        t = tenants.get(name)
        for q, limit in (t.limits() if t else {}).items():
            if limit:
                quota.add_metric([name, q], limit)
    return [jobs, store, boxes, quota, *_fair_families(r, tenants)]


def _fair_families(r: redis.Redis, tenants: dict) -> list:
    """Fair share (prorl_farm/fair_view.py): each queue's slots, and per tenant with work there
    its slots held, jobs waiting, share received and due; slots handed out over time."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from prorl_farm import fair_view as fair

    slots = GaugeMetricFamily("prorl_fair_slots", "A queue's slots its live pools share out "
                              "(shared) and keep for tenants under their share (reserve).",
                              labels=["queue", "kind"])
    held = GaugeMetricFamily("prorl_fair_held", "Slots of a queue a tenant's jobs hold.",
                             labels=["queue", "tenant"])
    waiting = GaugeMetricFamily("prorl_fair_waiting", "A tenant's jobs waiting for a slot of "
                                "a queue.", labels=["queue", "tenant"])
    received = GaugeMetricFamily("prorl_fair_share_received", "A tenant's part of a queue's "
                                 "slots held (0..1).", labels=["queue", "tenant"])
    due = GaugeMetricFamily("prorl_fair_share_due", "A tenant's weight over the weights of "
                            "the tenants with work on a queue (0..1).",
                            labels=["queue", "tenant"])
    for row in fair.shares(r, {n: t.weight for n, t in tenants.items()}):
        slots.add_metric([row["queue"], "shared"], row["shared"])
        slots.add_metric([row["queue"], "reserve"], row["reserve"])
        for t in row["tenants"]:
            labels = [row["queue"], t["tenant"]]
            held.add_metric(labels, t["held"])
            waiting.add_metric(labels, t["waiting"])
            received.add_metric(labels, t["received"])
            due.add_metric(labels, t["due"])
    given = CounterMetricFamily("prorl_fair_reserve_given", "Reserve slots handed to a "
                                "tenant's jobs per stage.", labels=["stage", "tenant"])
    for (stage, tenant), n in sorted(fair.given(r).items()):
        given.add_metric([stage, tenant], n)
    warm = GaugeMetricFamily("prorl_warm_sandboxes", "A node's warm sandboxes (the READY "
                             "stage) now.", labels=["node", "status"])
    taken = CounterMetricFamily("prorl_warm_events", "A node's warm sandboxes handed to a job "
                                "(hit), INITs that found none (miss), built, and stopped "
                                "unused (expired).", labels=["node", "event"])
    for node, row in sorted(fair.warm_stats(r).items()):
        for status in ("ready", "building"):
            warm.add_metric([node, status], row[status])
        for event in ("hit", "miss", "built", "expired"):
            taken.add_metric([node, event], row[event])
    return [slots, held, waiting, received, due, given, warm, taken]
