"""Bounded retries with exponential backoff: the one loop the farm's clients share (the
trainer's client of the API, the LLM backends' clients) and the one pause schedule (the Gym
agent server's poll of results).

Imports nothing of the farm: the trainer's SDK uses it too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def backoff_s(attempt: int, base_s: float, cap_s: float = math.inf) -> float:
    """The pause before retry ``attempt`` (1, 2, ...): ``base_s``, twice it, four times...,
    at most ``cap_s``."""
    return min(cap_s, base_s * 2 ** max(0, attempt - 1))


def with_retries(once: Callable[[], T], retries: int, base_s: float,
                 cap_s: float = math.inf, *, retryable: Callable[[BaseException], bool],
                 on_retry: Callable[[int, BaseException], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """``once()``, tried up to ``retries`` + 1 times.
    An exception ``retryable`` accepts is followed by a pause (:func:`backoff_s`) and another
    try, unless the try was the last; any other exception, and the last try's, propagate.
    ``on_retry(attempt, exception)`` is told of each retried failure (attempt: 1, 2...)."""
    for attempt in range(1, retries + 2):
        last = attempt == retries + 1
        try:
            return once()
        except BaseException as e:
            if last or not retryable(e):
                raise
            if on_retry is not None:
                on_retry(attempt, e)
        sleep(backoff_s(attempt, base_s, cap_s))
    raise AssertionError("unreachable")
