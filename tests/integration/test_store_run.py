"""`Store.run`'s tries: the first outside tenacity, the rest tenacity's, with its waits."""

from __future__ import annotations

import time

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection

from effectledger_core.errors import StoreUnavailable
from effectledger_ledger.db.store import Store


class Flaky:
    """Raises StoreUnavailable on the first `failures` calls, then answers; notes each call."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[float] = []

    async def __call__(self, conn: AsyncConnection, answer: str) -> str:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.failures:
            raise StoreUnavailable("the database went away")
        return answer


async def test_a_transaction_that_succeeds_at_once_is_tried_once(store: Store) -> None:
    fn = Flaky(0)
    assert await store.run(fn, "ok") == "ok"
    assert len(fn.calls) == 1


async def test_the_tries_after_a_failed_first_wait_as_tenacity_says(store: Store) -> None:
    fn = Flaky(2)
    assert await store.run(fn, "ok") == "ok"
    assert len(fn.calls) == 3
    # RETRY_WAIT: 0.05 s then 0.1 s at least (plus jitter); a sleep never ends early.
    gaps = [b - a for a, b in zip(fn.calls, fn.calls[1:], strict=False)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1, gaps


@pytest.mark.parametrize("attempts", [1, 3])
async def test_the_first_try_counts_among_the_attempts(store: Store, attempts: int) -> None:
    fn = Flaky(99)
    with pytest.raises(StoreUnavailable):
        await store.run(fn, "never", attempts=attempts)
    assert len(fn.calls) == attempts


async def test_an_error_that_is_not_retryable_is_raised_at_once(store: Store) -> None:
    calls: list[int] = []

    async def broken(conn: AsyncConnection) -> None:
        calls.append(1)
        raise ValueError("a bug, not an outage")

    with pytest.raises(ValueError, match="a bug"):
        await store.run(broken)
    assert calls == [1]
