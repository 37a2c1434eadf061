"""The latency budget's arithmetic (effectledger_bench.budget): an operation's journal and the
client's stamps become six hops that add up to the whole, each beside its floor; a missing stamp
is an error, never a hop silently folded into its neighbour."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from effectledger_bench import budget

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _journal(call_ms: float = 1.0) -> list[tuple[str, datetime, dict[str, Any]]]:
    call_end = T0 + timedelta(milliseconds=10)
    return [
        ("intent_accepted", T0 + timedelta(milliseconds=2), {}),
        ("attempt_claimed", T0 + timedelta(milliseconds=6), {}),
        ("outcome_recorded", T0 + timedelta(milliseconds=13),
         {"at": call_end.isoformat(), "duration_ms": call_ms}),
    ]


def test_hops_follow_the_stamps_and_add_up_to_the_client_time() -> None:
    sent, answered = T0.timestamp(), (T0 + timedelta(milliseconds=20)).timestamp()
    ms = budget.hops(sent, answered, _journal(call_ms=1.5))
    assert list(ms) == [h.name for h in budget.HOPS]
    expected = {"submit_to_intent": 2, "intent_to_claim": 4, "claim_to_call": 2.5,
                "provider_call": 1.5, "call_to_outcome": 3, "outcome_to_answer": 7}
    assert ms == pytest.approx(expected, abs=1e-3)
    assert sum(ms.values()) == pytest.approx(20, abs=1e-3)


@pytest.mark.parametrize("kind", ["intent_accepted", "attempt_claimed", "outcome_recorded"])
def test_a_missing_journal_stamp_is_an_error(kind: str) -> None:
    journal = [e for e in _journal() if e[0] != kind]
    with pytest.raises(budget.MissingHop, match=kind):
        budget.hops(T0.timestamp(), T0.timestamp() + 1, journal)


def test_an_outcome_without_the_dispatchers_stamps_is_an_error() -> None:
    journal = [(k, at, {} if k == "outcome_recorded" else d) for k, at, d in _journal()]
    with pytest.raises(budget.MissingHop, match="dispatcher"):
        budget.hops(T0.timestamp(), T0.timestamp() + 1, journal)


def test_the_table_puts_each_hop_beside_its_floor() -> None:
    floors: dict[str, dict[str, float | None]] = {
        name: {"p50": 1.0, "p99": 2.0} for name in budget.FLOORS}
    sample = budget.hops(T0.timestamp(), (T0 + timedelta(milliseconds=20)).timestamp(),
                         _journal())
    table = budget.table([sample, sample], floors)
    assert set(table["hops"]) == {h.name for h in budget.HOPS}
    # intent_to_claim: a commit, a publish with its ack and a request-reply, 1 ms each here.
    row = table["hops"]["intent_to_claim"]
    assert (row["p50_ms"], row["floor_ms"], row["over_floor_ms"]) == (4.0, 3.0, 1.0)
    assert table["total_ms"]["p50"] == pytest.approx(20)
    text = budget.markdown({"client": table}, floors)
    for hop in budget.HOPS:
        assert f"| {hop.name} |" in text
    for name in budget.FLOORS:
        assert f"| {name} |" in text


def test_the_chain_floor_table_puts_ours_beside_the_skeleton_or_says_why_it_is_missing() -> None:
    from effectledger_bench.agentwait import skeleton_markdown

    text = skeleton_markdown({
        "n": 3, "ours_ms": {"p50": 11.1, "p99": 15.5}, "skeleton_ms": {"p50": 5.6, "p99": 8.7},
        "ours_over_skeleton_ms": {"p50": 5.5, "p99": 6.8},
        "cpu_ms_per_call": {"ledger": 4.8, "dispatcher-1": 2.7, "skeleton-ledger": 1.6,
                            "skeleton-dispatcher": 1.6}})
    assert "| ours | 11.1 | 15.5 | 4.8 / 2.7 |" in text
    assert "| skeleton | 5.6 | 8.7 | 1.6 / 1.6 |" in text
    assert "| ours - skeleton | 5.5 | 6.8 | |" in text
    missing = skeleton_markdown({"error": "RuntimeError: skeleton ledger exited with 1"})
    assert "not measured: RuntimeError: skeleton ledger exited with 1" in missing
