"""How a requested wait is read and capped, and which states end it."""

from __future__ import annotations

import pytest

from effectledger_core.errors import InvalidRequest
from effectledger_core.states import State
from effectledger_core.waiting import SETTLED, is_settled, parse_wait, wait_over


@pytest.mark.parametrize(("text", "seconds"), [
    (None, 0.0), ("", 0.0), ("10", 10.0), ("10s", 10.0), ("2.5", 2.5), ("500ms", 0.5),
    ("1m", 60.0), (" 3s ", 3.0)])
def test_wait_durations_are_read_in_seconds(text: str | None, seconds: float) -> None:
    assert parse_wait(text, cap_s=120) == seconds


def test_a_wait_beyond_the_cap_is_shortened_not_refused() -> None:
    assert parse_wait("3600s", cap_s=60) == 60


@pytest.mark.parametrize("text", ["soon", "-1", "1h", "1e3", "10 s s", "nan"])
def test_unreadable_waits_are_refused_naming_the_parameter(text: str) -> None:
    with pytest.raises(InvalidRequest, match="wait"):
        parse_wait(text)


def test_settled_means_at_rest_or_waiting_for_a_human() -> None:
    assert {s.value for s in SETTLED} == {
        "succeeded", "failed", "cancelled", "needs_review", "awaiting_approval"}
    for state in ("pending", "in_flight", "ambiguous", "awaiting_confirmation"):
        assert not is_settled(state)


def test_a_progress_wait_ends_at_any_change() -> None:
    assert not wait_over(State.PENDING.value, "pending")
    assert wait_over("in_flight", "pending")
    assert wait_over("succeeded", None) and not wait_over("in_flight", None)
