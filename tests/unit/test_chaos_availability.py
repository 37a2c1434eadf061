"""The proving ground's availability figures, from a synthetic history and fault log."""

from __future__ import annotations

from typing import Any

import pytest

from effectledger_chaos.availability import (
    DB_RECOVERY_S,
    GRACE_S,
    LEDGER_RECOVERY_S,
    STEP_S,
    availability,
)

T0 = 1_000_000.0  # the fault phase's start, wall clock


def submit(op: int, invoke: float, ok: float | None, process: str = "c0"
           ) -> list[dict[str, Any]]:
    lines = [{"f": "submit", "type": "invoke", "op": op, "process": process,
              "wall": T0 + invoke}]
    if ok is not None:
        lines.append({"f": "submit", "type": "ok", "op": op, "process": process,
                      "wall": T0 + ok})
    return lines


def steady(until: float, every: float = 0.2, first_op: int = 0, since: float = 0.0
           ) -> list[dict[str, Any]]:
    """Intents acknowledged 10 ms after they are sent, every `every` seconds."""
    out = []
    t, op = since, first_op
    while t < until:
        out += submit(op, t, t + 0.01)
        t, op = t + every, op + 1
    return out


def test_a_ledger_that_always_answers_is_never_unavailable() -> None:
    a = availability(steady(20.0), [], T0)
    assert a["stalled_s"] == 0 and a["unavailable_db_up_s"] == 0
    assert a["ack_latency_s"]["p50"] == pytest.approx(0.01, abs=1e-3)


def test_a_stall_while_the_database_is_up_counts_from_the_grace_on() -> None:
    # An intent sent at 10 s is acknowledged at 20 s; nothing else is acknowledged meanwhile.
    history = steady(10.0) + submit(999, 10.0, 20.0) + steady(30.0, first_op=1000, since=20.0)
    a = availability(history, [], T0)
    expected = 20.0 - 10.0 - GRACE_S
    assert a["unavailable_db_up_s"] == pytest.approx(expected, abs=3 * STEP_S)
    assert a["unavailable_periods"][0]["from_s"] == pytest.approx(11.0, abs=0.3)


def test_database_outages_and_ledger_restarts_are_not_counted_but_still_stall() -> None:
    history = steady(10.0) + submit(999, 10.0, 20.0) + steady(30.0, first_op=1000, since=20.0)
    faults = [{"kind": "pg_restart", "target": "postgres", "started_at": 10.0,
               "ended_at": 14.0},
              {"kind": "kill", "target": "ledger", "started_at": 15.0, "ended_at": 15.5,
               "restarted_at": 15.5, "listening_at": 17.0}]
    a = availability(history, faults, T0)
    assert a["stalled_s"] == pytest.approx(9.0, abs=3 * STEP_S)
    assert DB_RECOVERY_S == 1.0 and LEDGER_RECOVERY_S == 0.5
    # 11..20 stalled, minus 11..15 (database down, and its recovery second) and 15..17.5
    # (the ledger restarting until it listened, and its recovery half second).
    assert a["unavailable_db_up_s"] == pytest.approx(2.5, abs=3 * STEP_S)
    # The intent held across the restart was answered 3 s after the ledger listened again,
    # which the report shows beside the window it excuses.
    assert a["resumed_to_first_ack_s"]["max"] == pytest.approx(3.0, abs=0.02)
    [restart] = a["ledger_restarts"]
    assert restart["restarted_to_listening_s"] == pytest.approx(1.5)
    assert restart["broker_down"] is False


def test_a_slowed_database_link_is_set_apart_like_an_outage() -> None:
    history = steady(10.0) + submit(999, 10.0, 20.0) + steady(30.0, first_op=1000, since=20.0)
    faults = [{"kind": "net_latency", "target": "pg", "started_at": 9.0, "ended_at": 21.0},
              {"kind": "net_latency", "target": "nats", "started_at": 9.0, "ended_at": 21.0}]
    a = availability(history, faults, T0)
    assert a["unavailable_db_up_s"] == 0 and a["stalled_s"] > 8


def test_a_ledger_restarted_in_a_broker_outage_that_waits_for_the_broker_is_seen() -> None:
    """The bug this measures: a restarted ledger that listens only once NATS is back."""
    history = steady(10.0) + submit(999, 10.0, 40.0) + steady(50.0, first_op=1000, since=40.0)
    faults = [{"kind": "nats_long_outage", "target": "nats", "started_at": 9.0,
               "ended_at": 39.0},
              {"kind": "kill", "target": "ledger", "started_at": 10.0, "ended_at": 10.5,
               "restarted_at": 10.5, "listening_at": 39.5}]
    a = availability(history, faults, T0)
    [restart] = a["ledger_restarts"]
    assert restart["restarted_to_listening_s"] == pytest.approx(29.0)
    assert restart["broker_down"] is True


def test_ack_latency_during_a_broker_outage_uses_only_attempts_sent_in_it() -> None:
    history = steady(10.0) + submit(500, 12.0, 12.5) + submit(501, 13.0, 13.1)
    faults = [{"kind": "nats_restart", "target": "nats", "started_at": 11.0,
               "ended_at": 14.0}]
    out = availability(history, faults, T0)["ack_latency_during_broker_outage_s"]
    assert out["n"] == 2
    assert out["max"] == pytest.approx(0.5)


def test_a_callers_backoff_between_attempts_is_not_the_ledgers() -> None:
    """Refused while the ledger restarts, the caller waits 2 s before it tries again; the
    ledger listened long before. Only attempts the ledger held count as stalls."""
    refused = [
        {"f": "submit", "type": "invoke", "op": 999, "process": "c9", "wall": T0 + 10.0},
        {"f": "submit", "type": "fail", "op": 999, "process": "c9", "wall": T0 + 10.01}]
    history = [*steady(10.0), *refused, *submit(999, 12.0, 12.01, process="c9"),
               *steady(20.0, first_op=1000, since=12.0)]
    faults = [{"kind": "kill", "target": "ledger", "started_at": 9.9, "ended_at": 10.2,
               "restarted_at": 10.2, "listening_at": 10.5}]
    a = availability(history, faults, T0)
    assert a["unavailable_db_up_s"] == 0 and a["refused_db_up"] == 0


def test_a_refusal_while_the_database_is_up_is_counted() -> None:
    history = [
        *steady(10.0),
        {"f": "submit", "type": "invoke", "op": 999, "process": "c9", "wall": T0 + 10.0},
        {"f": "submit", "type": "info", "op": 999, "process": "c9", "wall": T0 + 10.01,
         "status": 503}]
    assert availability(history, [], T0)["refused_db_up"] == 1


def test_a_ledger_answering_what_it_held_right_after_a_pause_is_not_unavailable() -> None:
    # Paused 10..14 s; the intents it held are answered 0.2 s after it continues.
    history = steady(10.0) + submit(999, 10.0, 14.2) + steady(30.0, first_op=1000, since=14.2)
    pause = [{"kind": "pause", "target": "ledger", "started_at": 10.0, "ended_at": 14.0}]
    a = availability(history, pause, T0)
    assert a["unavailable_db_up_s"] == 0
    assert a["resumed_to_first_ack_s"]["max"] == pytest.approx(0.2, abs=0.02)
    # Answered only 1.5 s after it continued: the second past the recovery window counts.
    late = steady(10.0) + submit(999, 10.0, 15.5) + steady(30.0, first_op=1000, since=15.5)
    b = availability(late, pause, T0)
    assert b["unavailable_db_up_s"] == pytest.approx(1.0, abs=3 * STEP_S)


def test_an_armed_ledger_serving_before_its_crash_point_is_held_to_account() -> None:
    """A crash point restarts the ledger armed; until it reaches the point it serves as usual,
    so a stall then counts. The arming restart and the crash with its restart do not."""
    history = steady(10.0) + submit(999, 10.0, 20.0) + steady(40.0, first_op=1000, since=20.0)
    armed = {"kind": "crash_point", "target": "ledger", "started_at": 5.0,
             "armed_listening_at": 7.0, "died_at": 30.0, "restarted_at": 31.0,
             "listening_at": 33.0, "ended_at": 33.0}
    a = availability(history, [armed], T0)
    assert a["unavailable_db_up_s"] == pytest.approx(20.0 - 10.0 - GRACE_S, abs=3 * STEP_S)
    # The two restarts are excused, each with its recovery allowance.
    crash = {**armed, "armed_listening_at": 7.0, "died_at": 10.5}
    assert availability(history, [crash], T0)["unavailable_db_up_s"] == 0
    # A report from before these moments were recorded: the whole span, as it was measured.
    old = {k: v for k, v in armed.items() if k not in ("armed_listening_at", "died_at")}
    assert availability(history, [old], T0)["unavailable_db_up_s"] == 0


def test_with_replicas_a_killed_replica_is_timed_to_its_first_answer_once_back() -> None:
    """Two replicas; ledger-2 killed at 2 s, listening again at 3 s, first answers at 3.5 s:
    the clustered report's "back to first ack" is filled (0.5 s), not left empty."""
    history: list[dict[str, Any]] = []
    for i, t in enumerate([0.0, 1.0, 4.0, 5.0]):
        history += [{**line, "ledger": "ledger"} for line in submit(i, t, t + 0.01)]
    for i, t in enumerate([0.5, 1.5, 3.49, 4.5]):
        history += [{**line, "ledger": "ledger-2"} for line in submit(100 + i, t, t + 0.01)]
    records = [{"kind": "ledger_replica_kill", "target": "ledger-2", "started_at": 2.0,
                "ended_at": 3.0, "restarted_at": 2.5, "listening_at": 3.0}]
    a = availability(sorted(history, key=lambda h: h["wall"]), records, T0)
    assert a["resumed_to_first_ack_s"]["n"] == 1
    assert a["resumed_to_first_ack_s"]["max"] == pytest.approx(0.5, abs=0.001)
