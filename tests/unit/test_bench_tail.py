"""The report's tail section (tools/bench/effectledger_bench/tail.py) reads a phase's slowest
1 % and the stall evidence recorded beside it; a figure missing from a phase shows as a dash,
never as a crash of the report."""

from __future__ import annotations

from effectledger_bench import pauses
from effectledger_bench.pg import slow_statements
from effectledger_bench.tail import clusters, section


def test_acceptance_times_group_into_stalls() -> None:
    assert clusters([2.72] * 3 + [2.73]) == [(2.72, 4)]
    assert clusters([4.06, 2.01, 2.06, 2.11, 4.07]) == [(2.01, 3), (4.06, 2)]
    assert clusters([]) == []


def test_a_phase_row_carries_every_piece_of_evidence() -> None:
    phase = {"scenario": "half", "rep": 0, "latency_ms": {"p95": 37.0, "p99": 119.8},
             "stages_ms": {"slowest_1pct": {
                 "n": 3, "accepted_at_s": [1.36, 1.39, 3.0], "accepted_to_claimed_p50": 265.0,
                 "claimed_to_outcome_p50": 4.0, "outcome_to_recorded_p50": 1.5}},
             "ledger_stalls": {"loop_lag": {"samples": 54, "over_25ms": 2},
                               "gc_gen0": {"over_10ms": 1}, "gc_gen2": {"over_10ms": 0}},
             "dispatcher_stalls": {"loop_lag": {"samples": 50, "over_25ms": 1},
                                   "gc_gen1": {"over_10ms": 2}},
             "pg": {"checkpoints": 1, "slow": {"over_ms": 15, "commits": 2,
                                               "commit_max_ms": 36.6, "others": 0}},
             "machine_cpu_share": {"idle": 0.5, "iowait": 0.012, "steal": 0.031}}
    row = next(line for line in "\n".join(section([phase])).splitlines()
               if line.startswith("| half"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["half", "1", "37.0", "119.8", "3", "2 at 1.36, 1 at 3.00",
                     "265.0 / 4.0 / 1.5", "2 of 54 / 1 of 50", "1 / 2", "2, max 36.6", "1",
                     "3.1 / 1.2"]


def test_slow_commits_are_read_from_the_servers_log() -> None:
    log = (
        "2026-12-06 07:55:20.885 UTC [27669] LOG:  duration: 36.612 ms  statement: COMMIT;\n"
        "2026-12-06 07:55:20.924 UTC [27669] LOG:  duration: 26.3 ms  statement: COMMIT;\n"
        "2026-12-06 07:55:21.100 UTC [27670] LOG:  duration: 22.4 ms  execute "
        "__asyncpg_stmt_1a__: WITH inserted AS (INSERT INTO inbox ...\n"
        "2026-12-06 07:55:22.000 UTC [27670] LOG:  checkpoint starting: time\n")
    assert slow_statements(log) == {"over_ms": 15, "commits": 2, "commit_max_ms": 36.6,
                                    "others": 1}
    assert slow_statements("")["commits"] == 0


def test_a_phase_without_the_records_shows_dashes() -> None:
    old = {"scenario": "max", "rep": 1, "stages_ms": {"slowest_1pct": {"n": 1}}}
    row = next(line for line in "\n".join(section([old])).splitlines()
               if line.startswith("| max"))
    assert "-" in row
    assert section([{"scenario": "max"}]) == []


def test_stalls_of_several_processes_are_summed_and_a_vanished_one_left_out() -> None:
    lag = "effectledger_event_loop_lag_seconds_bucket"

    def scrape(le_10ms: float, total: float) -> pauses.Scrape:
        return {(lag, (("le", "0.01"),)): le_10ms, (lag, (("le", "0.025"),)): le_10ms,
                (lag, (("le", "+Inf"),)): total}

    before = {"a": scrape(10, 10), "b": scrape(5, 5), "gone": scrape(1, 1)}
    after = {"a": scrape(20, 22), "b": scrape(9, 9), "new": scrape(3, 4), "gone": None}
    out = pauses.delta_many(before, after)
    assert out is not None
    # a: 12 samples, 2 over 25 ms; b: 4, none; new (started in the phase): 4, 1 over.
    assert out["loop_lag"]["samples"] == 20
    assert out["loop_lag"]["over_25ms"] == 3
    assert pauses.delta_many({}, {"x": None}) is None


def test_the_slowest_carry_when_the_first_operation_was_accepted() -> None:
    """Seconds into the phase are counted from the first operation accepted, which is given as
    a UTC time so the stalls can be found in the services' logs and the database's."""
    from datetime import UTC, datetime, timedelta

    from effectledger_bench.measure import slowest

    t0 = datetime(2026, 12, 7, 15, 27, 59, 93284, tzinfo=UTC)

    def op(at_s: float, total_ms: float) -> dict[str, datetime | None]:
        a = t0 + timedelta(seconds=at_s)
        return {"accepted": a, "claimed": a, "outcome": a,
                "recorded": a + timedelta(milliseconds=total_ms)}

    out = slowest([op(0.0, 5.0), op(5.62, 40.0), *[op(1.0 + i / 100, 4.0) for i in range(98)]])
    assert out["first_accepted"] == "2026-12-07T15:27:59.093284+00:00"
    assert out["n"] == 1 and out["accepted_at_s"] == [5.62]


def test_the_ledgers_writer_time_is_read_from_its_transactions_histogram() -> None:
    """The phase's group-commit transactions: their count, the seconds they took (how long
    the writer was busy) and the mean; a service without the histogram (a dispatcher) has no
    such figure rather than a zero."""
    tx = "effectledger_db_transaction_duration_seconds"
    lbl = (("writer", "ledger"),)
    before = {(f"{tx}_count", lbl): 100.0, (f"{tx}_sum", lbl): 0.5}
    after = {(f"{tx}_count", lbl): 300.0, (f"{tx}_sum", lbl): 1.1}
    out = pauses.delta(before, after)
    assert out is not None
    assert out["writer"] == {"transactions": 200, "busy_s": 0.6, "mean_ms": 3.0}
    assert "writer" not in pauses.summarise({})
