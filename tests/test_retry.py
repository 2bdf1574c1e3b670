"""The shared retry loop: how many tries, which failures are retried, the pauses."""

from __future__ import annotations

import pytest

from prorl_farm.retry import backoff_s, with_retries


def test_retried_failures_then_success_and_the_pauses_between():
    tries, pauses, told = [], [], []

    def once():
        tries.append(len(tries) + 1)
        if len(tries) < 3:
            raise ConnectionError(f"try {len(tries)}")
        return "ok"

    assert with_retries(once, 4, 0.5, 0.8, retryable=lambda e: isinstance(e, ConnectionError),
                        on_retry=lambda a, e: told.append((a, str(e))),
                        sleep=pauses.append) == "ok"
    assert tries == [1, 2, 3] and pauses == [0.5, 0.8]
    assert told == [(1, "try 1"), (2, "try 2")]


def test_the_last_try_and_a_failure_not_retried_propagate_at_once():
    tries, pauses = [], []

    def always():
        tries.append(len(tries) + 1)
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        with_retries(always, 2, 1.0, retryable=lambda e: True, sleep=pauses.append)
    assert tries == [1, 2, 3] and pauses == [1.0, 2.0]
    tries.clear()
    with pytest.raises(ValueError):
        with_retries(lambda: tries.append(1) or int("x"), 5, 1.0,
                     retryable=lambda e: isinstance(e, ConnectionError), sleep=pauses.append)
    assert tries == [1]
    assert [backoff_s(a, 0.2, 5.0) for a in range(1, 8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
