"""What the dashboard shows: the farm at a glance, and one batch in detail.

Everything is read from Redis in a few pipelined round trips; nothing here writes.
"""

from __future__ import annotations

import math
from collections import Counter

from prorl_farm import keys
from prorl_farm.config import STAGES
from prorl_farm.metrics import BUCKETS_S, read_counters, read_histogram
from prorl_farm.states import ALL_STATES

# Finished jobs the rate of a batch is measured over (its newest ones).
RATE_WINDOW = 200
# Example messages kept per failure kind.
EXAMPLES = 3


def _quantile(raw: list, q: float) -> float | None:
    """Upper bound of the bucket holding quantile ``q`` of a histogram's counters."""
    buckets, _ = read_histogram(raw)
    total = buckets[-1][1]
    if total == 0:
        return None
    for (_bound, count), upper in zip(buckets, (*BUCKETS_S, math.inf)):
        if count >= q * total:
            return upper if upper != math.inf else None
    return None


def _rate(entries: list, now_ms: int) -> float | None:
    """Jobs per second from a batch stream's newest entries (their IDs are Redis ms times)."""
    if not entries:
        return None
    first = min(int(entry_id.split("-")[0]) for entry_id, _ in entries)
    # Up to now, not to the newest finish: a batch that stalls shows a falling rate.
    return len(entries) / max(1.0, (now_ms - first) / 1000)


def batch_progress(r, summaries: list[dict], now: float) -> list[dict]:
    """Adds ``rate_per_s`` (over its newest finished jobs) and ``eta_s`` to each summary."""
    pipe = r.pipeline(transaction=False)
    for s in summaries:
        pipe.xrevrange(keys.batch_stream(s["batch_id"]), count=RATE_WINDOW)
    for s, entries in zip(summaries, pipe.execute()):
        rate = None if s["complete"] else _rate(entries, int(now * 1000))
        s["rate_per_s"] = round(rate, 3) if rate else None
        left = s["total"] - s["finished"]
        s["eta_s"] = round(left / rate, 1) if rate and left else (0.0 if not left else None)
    return summaries


def trajectory_store_view(store, payloads) -> dict:
    """What the trajectory store holds (bytes, files, unacknowledged batches and the oldest
    one's age) and the room left on its medium."""
    stats = store.payload_stats()
    oldest = stats["oldest_unacked"]
    stats["oldest_unacked_age_s"] = (round(store.server_time() - oldest["since"], 3)
                                     if oldest else None)
    return {**stats, **(payloads.usage() if payloads is not None else {})}


def farm_overview(store, backends, settings, batches: int = 10, payloads=None,
                  tenants: dict | None = None) -> dict:
    """Queues, stages, pools, backends, sandboxes, jobs by state, tenants (``tenants``: the
    configured ones) and the newest batches."""
    from prorl_farm import fair_view as fair
    from prorl_farm.tenants import tenant_rows

    r = store.r
    now = store.server_time()
    snap = read_counters(r, api=False)
    queue_rows = []
    for q, (depth, oldest) in snap.queues.items():
        stage, _, node = q.partition(".")
        queue_rows.append({"queue": q, "stage": stage, "node": node or None, "depth": depth,
                           "oldest_wait_s": round(now - oldest, 3) if oldest is not None else None})
    stages = {stage: {kind: _hist_summary(snap.hists[f"{kind}:{stage}"])
                      for kind in ("wait", "active")} for stage in STAGES}
    pools = store.live_pools(settings.heartbeat_stale_s)
    return {
        "now": now,
        "node_count": len({p.split(":", 1)[1] for p in pools}),
        "pools": [{"stage": p.split(":", 1)[0], "node": p.split(":", 1)[1], "age_s": age}
                  for p, age in sorted(pools.items())],
        "queues": queue_rows,
        "stages": stages,
        "jobs": {s: max(0, int(snap.states.get(s, 0))) for s in ALL_STATES},
        "failures": {k: int(v) for k, v in sorted(snap.failures.items())},
        "reaper": {k: int(v) for k, v in sorted(snap.reaper.items())},
        "sandboxes": [{"node": n, "live": int(lv), "started": int(snap.started.get(n, 0))}
                      for n, lv in snap.live.items()],
        "backends": backends,
        "batches": batch_progress(r, store.recent_batches(batches), now),
        "trajectories": trajectory_store_view(store, payloads),
        "tenants": tenant_rows(r, tenants or {}),
        "fair_share": fair.shares(r, {n: t.weight for n, t in (tenants or {}).items()}),
        "warm": [{"node": node, **row} for node, row in sorted(fair.warm_stats(r).items())],
    }


def _hist_summary(raw: list) -> dict:
    buckets, total = read_histogram(raw)
    count = buckets[-1][1]
    return {"count": count, "mean_s": round(total / count, 6) if count else None,
            "p50_s": _quantile(raw, 0.5), "p90_s": _quantile(raw, 0.9),
            "p99_s": _quantile(raw, 0.99)}


def _reward_histogram(rewards: list[float]) -> list[dict]:
    """Counts per distinct value when there are few (0/1 rewards), else ten equal bins."""
    if not rewards:
        return []
    distinct = Counter(rewards)
    if len(distinct) <= 10:
        return [{"low": v, "high": v, "count": n} for v, n in sorted(distinct.items())]
    lo, hi = min(rewards), max(rewards)
    width = (hi - lo) / 10
    counts = [0] * 10
    for x in rewards:
        counts[min(9, int((x - lo) / width))] += 1
    return [{"low": round(lo + i * width, 6), "high": round(lo + (i + 1) * width, 6),
             "count": n} for i, n in enumerate(counts)]


def batch_stats(store, batch_id: str) -> dict:
    """One batch: progress, rate and ETA, rewards (mean and distribution), failures by kind
    with examples, end-to-end time quantiles."""
    summary = store.batch_summary(batch_id)  # 404 for an unknown batch
    ids = store.batch_job_ids(batch_id)
    pipe = store.r.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(keys.job(job_id), "state", "reward", "failure_kind", "failure_message",
                   "created_at", "finished_at")
    rows = pipe.execute()
    rewards, durations, failures = [], [], {}
    for job_id, (state, reward, kind, message, created, finished) in zip(ids, rows):
        if state == "done" and reward not in (None, ""):
            rewards.append(float(reward))
        if kind and state in ("failed", "cancelled"):
            f = failures.setdefault(kind, {"kind": kind, "state": state, "count": 0,
                                           "examples": []})
            f["count"] += 1
            if len(f["examples"]) < EXAMPLES:
                f["examples"].append({"job_id": job_id, "message": (message or "")[:500]})
        if created and finished:
            durations.append(float(finished) - float(created))
    durations.sort()

    def q(p: float) -> float | None:
        return round(durations[min(len(durations) - 1, int(p * len(durations)))], 3) \
            if durations else None

    [summary] = batch_progress(store.r, [summary], store.server_time())
    return {
        **summary,
        "reward": {"count": len(rewards),
                   "mean": round(sum(rewards) / len(rewards), 6) if rewards else None,
                   "histogram": _reward_histogram(rewards)},
        "failures": sorted(failures.values(), key=lambda f: -f["count"]),
        "duration_s": {"p50": q(0.5), "p90": q(0.9), "max": durations[-1] if durations
                       else None},
    }
