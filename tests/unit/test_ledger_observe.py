"""The ledger's observer: duplicate detections and latency bookkeeping, without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import REGISTRY

from effectledger_ledger.db import duplicates
from effectledger_ledger.db.common import journal_row
from effectledger_ledger.observe import Observer

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_committed_duplicate_detection_is_counted_by_tool() -> None:
    before = sample("effectledger_duplicates_detected_total", tool="send_email")
    duplicates.announce("send_email", 2, "op-dup")
    assert sample("effectledger_duplicates_detected_total", tool="send_email") == before + 1


def test_an_operation_accepted_before_a_restart_is_counted_untracked_not_timed() -> None:
    observer = Observer()
    untracked = sample("effectledger_latency_untracked_total")
    timed = sample("effectledger_operation_duration_seconds_count", tool="t",
                   state="succeeded")
    observer.committed([journal_row(operation_id="op-old", at=T0, kind="outcome_recorded",
                                    actor="d", epoch=1, from_state="in_flight",
                                    to_state="succeeded")])
    assert sample("effectledger_latency_untracked_total") == untracked + 1
    observer.accepted({"id": "op-new", "tool": "t", "created_at": T0})
    observer.committed([journal_row(operation_id="op-new", at=T0 + timedelta(seconds=2),
                                    kind="outcome_recorded", actor="d", epoch=1,
                                    from_state="in_flight", to_state="succeeded")])
    assert sample("effectledger_operation_duration_seconds_count", tool="t",
                  state="succeeded") == timed + 1
    assert sample("effectledger_latency_untracked_total") == untracked + 1


def test_the_acceptance_table_is_bounded() -> None:
    observer = Observer(capacity=3)
    for i in range(5):
        observer.accepted({"id": f"op{i}", "tool": "t", "created_at": T0})
    assert len(observer._ops) == 3
