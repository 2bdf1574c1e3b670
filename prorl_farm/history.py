"""The dashboard's history: the farm over the last day, a minute at a time, in Redis.

One hash per minute (``keys.history``), written where things happen and read back by the
API (``GET /v1/history``), so it survives a restart of the API (and, with the append-only
file, of Redis) and costs nothing to keep:

- ``ended:<state>``: jobs that reached a terminal state that minute (lua/lib/jobs.lua);
- ``failed:<kind>``: failed jobs by failure kind;
- ``reward_sum``, ``reward_n``, ``pass_n``: the rewards of jobs that ended done, and how
  many earned the full reward (1.0 or more: a pass);
- ``wait_sum:<stage>``, ``wait_n:<stage>``: the queue waits of jobs that a stage's pool
  claimed, taken every ``SAMPLE_S`` from the stage's wait histogram (which each claim
  keeps, lua/claim.lua) by the process that leads the reaping (worker/reaper.py,
  lua/history_waits.lua): a wait counts in the minute of the sample after its claim;
- ``load_sum:<backend>``, ``latency_sum:<backend>``, ``samples:<backend>``,
  ``capacity:<backend>``: each backend's jobs in flight and latency (its moving average),
  sampled every ``SAMPLE_S`` by the same process.

Each hash expires ``TTL_S`` after its last write: memory is bounded (a few KiB a minute).
"""

from __future__ import annotations

import math
import time

from prorl_farm import keys
from prorl_farm.config import STAGES
from prorl_farm.metrics import HISTORY_STEP_S as STEP_S
from prorl_farm.metrics import HISTORY_TTL_S as TTL_S

SAMPLE_S = 10.0  # stage waits, backend load and latency samples


def record_waits(store) -> int:
    """The stage waits of the jobs claimed since the last call, into this minute's history
    (a JobStore's scripts); returns how many."""
    return int(store.lua("history_waits", stages=list(STAGES)))


def record_backends(r, backends: list[dict], now: float | None = None) -> None:
    """One sample of every backend's load (jobs pinned to it) and latency."""
    if not backends:
        return
    now = time.time() if now is None else now
    hk = keys.history(str(int(now // STEP_S * STEP_S)))
    pipe = r.pipeline(transaction=False)
    for b in backends:
        bid = b["id"]
        pipe.hincrbyfloat(hk, f"load_sum:{bid}", float(b["in_flight"]))
        pipe.hincrbyfloat(hk, f"latency_sum:{bid}", float(b.get("latency_ms") or 0.0))
        pipe.hincrbyfloat(hk, f"samples:{bid}", 1)
        pipe.hset(hk, f"capacity:{bid}", b["capacity"])
    pipe.expire(hk, TTL_S)
    pipe.execute()


def _num(raw: dict, name: str) -> float:
    v = raw.get(name)
    return float(v) if v not in (None, "") else 0.0


def _ratio(a: float, b: float, digits: int = 4) -> float | None:
    return round(a / b, digits) if b else None


def series(r, window_s: float, now: float | None = None) -> dict:
    """The last ``window_s`` seconds, a point per minute (oldest first): jobs ended per
    minute by state, failures by kind, mean reward and pass rate (with the counts they
    come from: ``rewards``, ``reward_sum``, ``passes``), mean queue wait per stage, and per
    backend its mean jobs in flight, capacity and mean latency. A minute with nothing
    recorded has zero counts and null means."""
    now = time.time() if now is None else now
    last = int(now // STEP_S * STEP_S)
    count = max(1, min(int(math.ceil(window_s / STEP_S)), TTL_S // STEP_S))
    minutes = [last - STEP_S * i for i in range(count - 1, -1, -1)]
    pipe = r.pipeline(transaction=False)
    for m in minutes:
        pipe.hgetall(keys.history(str(m)))
    rows = pipe.execute()
    states: set[str] = set()
    kinds: set[str] = set()
    backends: set[str] = set()
    for raw in rows:
        for f in raw:
            head, _, tail = f.partition(":")
            if head == "ended":
                states.add(tail)
            elif head == "failed":
                kinds.add(tail)
            elif head == "samples":
                backends.add(tail)
    out = {
        "step_s": STEP_S, "minutes": minutes, "kept_s": TTL_S,
        "ended": {s: [int(_num(raw, f"ended:{s}")) for raw in rows] for s in sorted(states)},
        "failures": {k: [int(_num(raw, f"failed:{k}")) for raw in rows] for k in sorted(kinds)},
        "reward_mean": [_ratio(_num(raw, "reward_sum"), _num(raw, "reward_n")) for raw in rows],
        "pass_rate": [_ratio(_num(raw, "pass_n"), _num(raw, "reward_n")) for raw in rows],
        "rewards": [int(_num(raw, "reward_n")) for raw in rows],
        "reward_sum": [round(_num(raw, "reward_sum"), 6) for raw in rows],
        "passes": [int(_num(raw, "pass_n")) for raw in rows],
        "wait_s": {st: [_ratio(_num(raw, f"wait_sum:{st}"), _num(raw, f"wait_n:{st}"))
                        for raw in rows] for st in STAGES},
        "backends": {},
    }
    for b in sorted(backends):
        out["backends"][b] = {
            "in_flight": [_ratio(_num(raw, f"load_sum:{b}"), _num(raw, f"samples:{b}"), 2)
                          for raw in rows],
            "capacity": [int(_num(raw, f"capacity:{b}")) or None for raw in rows],
            "latency_ms": [_ratio(_num(raw, f"latency_sum:{b}"), _num(raw, f"samples:{b}"), 1)
                           for raw in rows],
        }
    return out
