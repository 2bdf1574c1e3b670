"""Reading kombu's Redis transport: the messages reserved by workers and not yet acked.

kombu's own transport keeps every message a worker reserved (acks late) in the ``unacked``
hash, indexed by reservation time in ``unacked_index``, until the worker acks it; a worker
that dies leaves its reserved messages there until the visibility timeout has them
redelivered. The farm's pools keep no such records (worker/broker.py); a plain ``celery
worker`` on kombu's own transport does, and the reaper reads them (*orphan*). Also the
decoding of a farm message's task arguments.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from prorl_farm import keys


@dataclass(frozen=True)
class Reserved:
    """A farm stage message some worker reserved: its delivery tag, job, token, and when it
    was reserved (the reserving worker's clock)."""

    tag: str
    job_id: str
    token: str
    at: float


def message_args(raw: dict) -> list:
    """The task args of a raw kombu message (Celery protocol 2: body = [args, kwargs, ...])."""
    body = raw.get("body", "")
    if raw.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    decoded = json.loads(body)
    return decoded[0] if isinstance(decoded, list) and decoded else []


def reserved_messages(r, before: float = float("inf"), limit: int = 100_000) -> list[Reserved]:
    """Farm messages reserved by some worker before ``before`` and not acked yet."""
    rows = r.zrangebyscore(keys.KOMBU_UNACKED_INDEX, "-inf", before, start=0, num=limit,
                           withscores=True)
    if not rows:
        return []
    out = []
    tags = [tag for tag, _ in rows]
    for (tag, at), value in zip(rows, r.hmget(keys.KOMBU_UNACKED, tags)):
        if value is None:
            continue
        try:
            args = message_args(json.loads(value)[0])
        except (ValueError, TypeError, KeyError, IndexError):
            continue  # not a message of ours
        if len(args) == 2 and all(isinstance(a, str) for a in args):
            out.append(Reserved(tag, args[0], args[1], at))
    return out


def settle(r, tags: list[str]) -> None:
    """Drop reserved messages whose job the reaper has dealt with: kombu will not redeliver
    them (a redelivery would be a no-op anyway) and no sweep looks at them again."""
    if tags:
        pipe = r.pipeline(transaction=True)
        pipe.hdel(keys.KOMBU_UNACKED, *tags)
        pipe.zrem(keys.KOMBU_UNACKED_INDEX, *tags)
        pipe.execute()
