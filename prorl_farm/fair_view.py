"""What sharing the farm looks like now, for the dashboard, ``/metrics`` and ``prorl-farm
tenants``: per queue, its live slots, and per tenant with work there, the slots it holds,
the jobs it has waiting, its share received and its share due (the sharing itself happens
in Redis, lua/lib/fair.lua); per node, its warm sandboxes (worker/warm.py).
"""

from __future__ import annotations

import json

from prorl_farm import keys


def _slots(raw: dict[str, str], now: float) -> tuple[int, int]:
    shared = reserve = 0
    for value in raw.values():
        parts = value.split()
        if len(parts) == 3 and float(parts[2]) > now:
            shared += int(float(parts[0]))
            reserve += int(float(parts[1]))
    return shared, reserve


def shares(r, weights: dict[str, float] | None = None) -> list[dict]:
    """One row per queue: {queue, stage, shared, reserve, held, tenants: [{tenant, weight,
    held, waiting, received, due, due_slots}]}. ``received``: the tenant's part of the
    slots held; ``due``: its weight's part of the weights of the tenants holding or waiting
    there (both 0..1). ``weights``: the configured ones (else those the pools wrote)."""
    queues = sorted(r.smembers(keys.QUEUES) | {"init"})
    pipe = r.pipeline(transaction=False)
    for queue in queues:
        pipe.hgetall(keys.slots(queue))
        pipe.hgetall(keys.held(queue))
        pipe.smembers(keys.pen_flows(queue))
    pipe.hgetall(keys.WEIGHTS)
    pipe.time()
    raw = pipe.execute()
    stored, (sec, usec) = raw[-2], raw[-1]
    now = sec + usec / 1e6
    weights = {**{t: float(w) for t, w in stored.items()}, **(weights or {})}
    flows_of: dict[str, list[str]] = {}
    pipe = r.pipeline(transaction=False)
    for i, queue in enumerate(queues):
        flows_of[queue] = sorted(raw[3 * i + 2])
        for flow in flows_of[queue]:
            pipe.zcard(keys.pen(queue, flow))
    counts = iter(pipe.execute())
    out = []
    for i, queue in enumerate(queues):
        shared, reserve = _slots(raw[3 * i], now)
        held: dict[str, int] = {}
        total = 0
        for field, n in raw[3 * i + 1].items():
            if (tenant := keys.flow_tenant(field)) is not None:
                held[tenant] = held.get(tenant, 0) + int(n)
                total += max(0, int(n))
        waiting: dict[str, int] = {}
        for flow in flows_of[queue]:
            tenant = keys.flow_tenant(flow) or flow
            waiting[tenant] = waiting.get(tenant, 0) + next(counts)
        names = sorted({t for t, n in held.items() if n > 0} | {t for t, n in waiting.items()
                                                                 if n > 0})
        if not names and not shared and not total:
            continue
        sum_w = sum(weights.get(t, 1.0) for t in names) or 1.0
        rows = []
        for t in names:
            w = weights.get(t, 1.0)
            h = max(0, held.get(t, 0))
            rows.append({"tenant": t, "weight": w, "held": h, "waiting": waiting.get(t, 0),
                         "received": round(h / total, 4) if total else 0.0,
                         "due": round(w / sum_w, 4),
                         "due_slots": round(shared * w / sum_w, 2)})
        out.append({"queue": queue, "stage": queue.partition(".")[0], "shared": shared,
                    "reserve": reserve, "held": total, "tenants": rows})
    return out


def given(r) -> dict[tuple[str, str], int]:
    """Reserve slots handed out per (stage, tenant) over the farm's life."""
    out: dict[tuple[str, str], int] = {}
    for field, n in r.hgetall(keys.FAIR_GIVEN).items():
        stage, _, rest = field.partition(":")
        tenant, _, kind = rest.partition(":")
        if kind == "reserve":
            out[(stage, tenant)] = int(n)
    return out


def warm_stats(r) -> dict[str, dict]:
    """Per node: warm sandboxes ready and being built now, and hits, misses, builds and
    expiries over the farm's life, with the hit rate."""
    out: dict[str, dict] = {}
    for field, n in r.hgetall(keys.WARM_STATS).items():
        node, _, kind = field.rpartition(":")
        out.setdefault(node, {"ready": 0, "building": 0, "hit": 0, "miss": 0, "built": 0,
                              "expired": 0})[kind] = int(n)
    for node, row in out.items():
        for raw in r.hvals(keys.warm(node)):
            row["ready" if json.loads(raw)["status"] == "ready" else "building"] += 1
        taken = row["hit"] + row["miss"]
        row["hit_rate"] = round(row["hit"] / taken, 4) if taken else None
    return out
