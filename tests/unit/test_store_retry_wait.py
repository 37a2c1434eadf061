"""The ledger's database retries: ride out a restart of a few seconds, then come back quickly."""

from __future__ import annotations

from tenacity import RetryCallState

from effectledger_ledger.db.store import RETRY_ATTEMPTS, RETRY_WAIT


def _waits() -> list[float]:
    out = []
    for n in range(1, RETRY_ATTEMPTS):  # a wait after every try but the last
        state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
        state.attempt_number = n
        out.append(RETRY_WAIT(state))
    return out


def test_no_wait_is_longer_than_about_half_a_second() -> None:
    # Once the database answers again, the next try is at most this far away: a second of
    # tenacity's default jitter here showed up as intake unavailable in the proving ground.
    for _ in range(50):
        assert max(_waits()) <= 0.5


def test_the_tries_span_a_short_database_restart() -> None:
    for _ in range(50):
        assert sum(_waits()) >= 3.0
