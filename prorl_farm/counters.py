"""Counter arrays: a Redis string of signed 64-bit counters at fixed slots (BITFIELD).

A batch's per-state counts and a histogram's buckets and sum are each one such string, so
a transition moves a job between two states, and an observation adds to a bucket and to
the sum, in one BITFIELD command where a hash needs one HINCRBY per field. Slot ``i`` is
``#i`` of type ``i64``; a missing key reads as all zeros.

The Lua side (lua/lib/jobs.lua, lua/lib/metrics.lua) writes the same layout; the slots of
the states (``STATE_SLOT``) and of the histogram's sum (``SUM_SLOT``) reach it generated
from here (lua/__init__.py).
"""

from __future__ import annotations

TYPE = "i64"


def incr_args(deltas: dict[int, int]) -> list:
    """BITFIELD arguments adding ``deltas`` (slot -> integer) to their counters."""
    out: list = []
    for slot, delta in deltas.items():
        out += ["INCRBY", TYPE, f"#{slot}", int(delta)]
    return out


def incr(client, key: str, deltas: dict[int, int]):
    """Add ``deltas`` to the counters of ``key`` (on a client or a pipeline)."""
    return client.execute_command("BITFIELD", key, *incr_args(deltas))


def read(client, key: str, slots: int):
    """The first ``slots`` counters of ``key`` (on a client or a pipeline: a list of ints
    in its reply)."""
    args: list = []
    for slot in range(slots):
        args += ["GET", TYPE, f"#{slot}"]
    return client.execute_command("BITFIELD_RO", key, *args)
