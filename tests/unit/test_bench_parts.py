"""The benchmark harness's pure parts: percentiles, summaries, SQL capture, report rendering."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from effectledger_bench.measure import OpRow, check_effects, latency_stats, percentile, summary
from effectledger_bench.pg import parse_lsn
from effectledger_bench.report import render, targets
from effectledger_bench.sqlcapture import extract, pgbench_script
from effectledger_bench.tables import mmm

OP = "13e691d5c68d456dbe7eccdc7db39d87"
OUTBOX = "554618b400db4fad8d8bc44fc40113f9"
ATTEMPT = "f917f1ad99374af48dfdf878de27bdce"
KEY = "ck_8b620acd3c7b19f1c3df60fb944614c28b70d257"

LOG = f"""\
2026-11-30 03:22:40.180 UTC [23076] 0 LOG:  statement: BEGIN;
2026-11-30 03:22:40.180 UTC [23076] 0 LOG:  statement: ROLLBACK;
2026-11-30 03:22:40.180 UTC [23076] 0 LOG:  statement: BEGIN;
2026-11-30 03:22:40.181 UTC [23076] 0 LOG:  execute __asyncpg_stmt_2d__: SELECT operations.id \
FROM operations WHERE operations.operation_key = $1::VARCHAR
2026-11-30 03:22:40.181 UTC [23076] 0 DETAIL:  parameters: $1 = '{KEY}'
2026-11-30 03:22:40.182 UTC [23076] 741 LOG:  execute __asyncpg_stmt_2e__: INSERT INTO operations \
(id, operation_key) VALUES ($1::VARCHAR, $2::VARCHAR)
2026-11-30 03:22:40.182 UTC [23076] 741 DETAIL:  parameters: $1 = '{OP}', $2 = '{KEY}'
2026-11-30 03:22:40.182 UTC [23076] 741 LOG:  execute __asyncpg_stmt_30__: INSERT INTO outbox \
(id, operation_id, payload) VALUES ($1::VARCHAR, $2::VARCHAR, $3::VARCHAR)
2026-11-30 03:22:40.182 UTC [23076] 741 DETAIL:  parameters: $1 = '{OUTBOX}', $2 = '{OP}', \
$3 = '{{"schema_version":1,"operation_id":"{OP}","it''s":"x"}}'
2026-11-30 03:22:40.182 UTC [23076] 741 LOG:  statement: COMMIT;
2026-11-30 03:22:40.185 UTC [23083] 0 LOG:  statement: BEGIN;
2026-11-30 03:22:40.186 UTC [23083] 0 LOG:  execute __asyncpg_stmt_59__: SELECT outbox.id
\tFROM outbox
\tWHERE outbox.status = $1::VARCHAR LIMIT $2::INTEGER FOR UPDATE SKIP LOCKED
2026-11-30 03:22:40.186 UTC [23083] 0 DETAIL:  parameters: $1 = 'pending', $2 = '256'
2026-11-30 03:22:40.188 UTC [23083] 742 LOG:  execute __asyncpg_stmt_5b__: UPDATE outbox SET \
status=$1::VARCHAR WHERE outbox.id IN ($2::VARCHAR)
2026-11-30 03:22:40.188 UTC [23083] 742 DETAIL:  parameters: $1 = 'publishing', $2 = '{OUTBOX}'
2026-11-30 03:22:40.188 UTC [23083] 742 LOG:  statement: COMMIT;
2026-11-30 03:22:40.190 UTC [23099] 0 LOG:  statement: BEGIN;
2026-11-30 03:22:40.190 UTC [23099] 0 LOG:  execute __asyncpg_stmt_60__: SELECT 1 FROM outbox \
WHERE status = $1::VARCHAR
2026-11-30 03:22:40.190 UTC [23099] 0 DETAIL:  parameters: $1 = 'published'
2026-11-30 03:22:40.190 UTC [23099] 0 LOG:  statement: COMMIT;
2026-11-30 03:22:40.205 UTC [23073] 0 LOG:  statement: BEGIN;
2026-11-30 03:22:40.208 UTC [23073] 744 LOG:  execute __asyncpg_stmt_61__: INSERT INTO attempts \
(id, operation_id) VALUES ($1::VARCHAR, $2::VARCHAR)
2026-11-30 03:22:40.208 UTC [23073] 744 DETAIL:  parameters: $1 = '{ATTEMPT}', $2 = '{OP}'
2026-11-30 03:22:40.209 UTC [23073] 744 LOG:  statement: COMMIT;
2026-11-30 03:22:40.218 UTC [23076] 0 LOG:  statement: BEGIN;
2026-11-30 03:22:40.218 UTC [23076] 0 LOG:  execute __asyncpg_stmt_62__: INSERT INTO inbox \
(consumer, message_id) VALUES ($1::VARCHAR, $2::VARCHAR) ON CONFLICT DO NOTHING
2026-11-30 03:22:40.218 UTC [23076] 0 DETAIL:  parameters: $1 = 'ledger-inbox', \
$2 = 'attempt_succeeded:{ATTEMPT}'
2026-11-30 03:22:40.222 UTC [23076] 745 LOG:  statement: COMMIT;
"""


def test_percentile_is_nearest_rank() -> None:
    """p50 of 1..100 is 50, p99 is 99, p99.9 of 100 values is the maximum."""
    values = [float(v) for v in range(100, 0, -1)]
    assert percentile(values, 50) == 50
    assert percentile(values, 99) == 99
    assert percentile(values, 99.9) == 100
    assert percentile(values, 100) == 100
    assert percentile([7.0], 50) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 0)


def test_summary_gives_min_median_max_and_skips_missing() -> None:
    assert summary([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert summary([4.0, 1.0, None, 2.0, 3.0]) == {"min": 1.0, "median": 2.5, "max": 4.0}
    assert summary([]) == {"min": None, "median": None, "max": None}
    assert mmm([1.0, 2.0, 30.0]) == "2.0 (1.0-30.0)"
    assert mmm([5.0]) == "5.0"


def test_latency_stats_from_ledger_timestamps() -> None:
    """Throughput spans first acceptance to last success; latency is per operation."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    rows = [OpRow(f"op{i}", "succeeded", f"k{i}", "t", t0 + timedelta(seconds=i / 10),
                  t0 + timedelta(seconds=i / 10, milliseconds=10 + i)) for i in range(10)]
    rows.append(OpRow("opx", "ambiguous", "kx", "t", t0, None))
    stats = latency_stats(rows)
    assert stats["operations"] == 11 and stats["succeeded"] == 10
    assert stats["states"] == {"succeeded": 10, "ambiguous": 1}
    assert stats["span_s"] == pytest.approx(0.919)
    assert stats["latency_ms"]["p50"] == pytest.approx(14.0)
    assert stats["latency_ms"]["max"] == pytest.approx(19.0)


def test_effect_check_finds_lost_duplicated_and_lies() -> None:
    ops = [("a", "succeeded", "ka", "t"), ("b", "succeeded", "kb", "t"),
           ("c", "failed", "kc", "t"), ("d", "pending", "kd", "t"),
           ("e", "ambiguous", "ke", "t")]
    truth = {"keys": {"ka": {"applied": 1}, "kb": {"applied": 0}, "kc": {"applied": 1},
                      "ke": {"applied": 2}, "dbos-1": {"applied": 2}, "stray": {"applied": 1}}}
    got = check_effects(ops, truth, ["a", "b", "zz"], peer_prefixes=("dbos-",))
    assert got["lost_detail"] == {"acknowledged_without_row": 1, "succeeded_not_applied": 1,
                                  "still_moving": 1}
    assert got["lost"] == 3 and got["duplicated"] == 1 and got["failed_but_applied"] == 1
    assert got["peers"]["dbos-"] == {"keys": 1, "applied": 2, "duplicated": 1}
    assert got["unknown_provider_keys_applied"] == 1 and got["ok"] is False
    clean = check_effects([("a", "succeeded", "ka", "t")], {"keys": {"ka": {"applied": 1}}},
                          ["a"])
    assert clean["ok"] is True


def test_sql_capture_keeps_the_operations_transactions_only() -> None:
    """Transactions are found transitively (outbox id, attempt id); unrelated ones are not."""
    got = extract(LOG, [OP])
    assert got.consistent
    ((_op, txns, ids),) = got.per_op
    assert ids == {OP, OUTBOX, ATTEMPT, KEY}
    assert len(txns) == 4  # submit, lease, claim, inbox; not the unrelated SELECT
    assert txns[0].preping and not txns[1].preping
    assert "FOR UPDATE SKIP LOCKED" in txns[1].text  # the lease SELECT has no id itself
    assert "'pending'::VARCHAR" in txns[1].text and "$1" not in txns[1].text


def test_sql_capture_leaves_out_the_drivers_one_off_type_introspection() -> None:
    """asyncpg looks an array type up once per connection; that is no operation's cost, and
    replayed by pgbench on every transaction it made the reference four times slower."""
    introspection = """\
2026-11-30 03:22:40.180 UTC [23076] 0 LOG:  execute __asyncpg_stmt_36__:\x20
\t                    SELECT
\t                        current_setting('jit') AS cur,
\t                        set_config('jit', 'off', false) AS new
2026-11-30 03:22:40.180 UTC [23076] 0 LOG:  execute __asyncpg_stmt_37__: WITH RECURSIVE \
typeinfo_tree(oid, ns) AS (SELECT 1) SELECT * FROM typeinfo_tree WHERE oid = any($1::oid[])
2026-11-30 03:22:40.180 UTC [23076] 0 DETAIL:  parameters: $1 = '{1015}'
2026-11-30 03:22:40.180 UTC [23076] 0 LOG:  execute __asyncpg_stmt_38__:\x20
\t                    SELECT
\t                    set_config('jit', $1, false)
2026-11-30 03:22:40.180 UTC [23076] 0 DETAIL:  parameters: $1 = 'on'
"""
    first_begin = "2026-11-30 03:22:40.180 UTC [23076] 0 LOG:  statement: BEGIN;\n"
    at = LOG.index(first_begin, LOG.index(first_begin) + 1) + len(first_begin)
    got = extract(LOG[:at] + introspection + LOG[at:], [OP])
    ((_op, txns, _ids),) = got.per_op
    assert len(txns) == 4
    assert len(txns[0].statements) == 5  # BEGIN, SELECT, two INSERTs, COMMIT: as without it
    assert "typeinfo_tree" not in txns[0].text and "jit" not in txns[0].text
    assert extract(LOG, [OP]).shapes == got.shapes


def test_pgbench_script_makes_identifiers_unique_per_transaction() -> None:
    ((_op, txns, ids),) = extract(LOG, [OP]).per_op
    script = pgbench_script(txns, ids)
    for ident in (OP, OUTBOX, ATTEMPT, KEY):
        assert ident not in script
    assert r"\set n random(" in script
    assert "'attempt_succeeded:b" in script and "-:client_id-:n'" in script
    assert script.count("BEGIN;") == 5 and script.count("COMMIT;") == 4  # 1 pre-ping pair
    assert "it''s" in script  # quoting of logged literals is preserved


def test_parse_lsn() -> None:
    assert parse_lsn("0/1941A38") == 0x1941A38
    assert parse_lsn("1/0") == 1 << 32


def test_report_renders_targets_and_tables(tmp_path: Path) -> None:
    phase = {"scenario": "max", "params": {"dispatchers": 1}, "ops_per_s": 250.0,
             "latency_ms": {"p50": 10.0, "p95": 20.0, "p99": 30.0, "p99_9": 40.0},
             "system_cpu_ms_per_op": 4.0, "cpu_ms_per_op": {"ledger": 3.0},
             "pg": {"wal_commits_per_op": 5.0, "wal_bytes_per_op": 4000}}
    half = {**phase, "scenario": "half", "latency_ms": {"p99": 80.0},
            "system_cpu_ms_per_op": 6.0}
    results = {"phases": [phase, {**phase, "ops_per_s": 300.0}, half],
               "peers": [{"peer": "pgbench_limit", "clients": 16, "ops_per_s": 1000.0},
                         {"peer": "dbos_queue", "ops_per_s": 100.0},
                         # Each peer's best setting in a repetition is the one that counts.
                         {"peer": "temporal_local", "rep": 0, "concurrency": 16,
                          "ops_per_s": 50.0},
                         {"peer": "temporal_local", "rep": 0, "concurrency": 64,
                          "ops_per_s": 125.0},
                         {"peer": "temporal_activity", "rep": 0, "concurrency": 64,
                          "ops_per_s": 30.0},
                         {"peer": "no_durability", "rep": 0, "processes": 2,
                          "ops_per_s": 550.0},
                         {"peer": "dbos_direct", "rep": 0, "skipped": "not installed"}],
               "effects": {"ok": True, "lost": 0, "duplicated": 0, "failed_but_applied": 0},
               "peak_rss_mib": {"ledger": 120.0, "dispatcher-1": 70.0}}
    rows = {r[0].split(" (")[0]: r for r in targets(results)}
    assert rows["≥ 1,000 ops/s end to end"][2] == "**missed**"
    assert "short by 725.0" in rows["≥ 1,000 ops/s end to end"][1]
    assert rows["≥ 1.0 x pgbench limit"][1].startswith("0.28 x")
    assert rows["≥ 8 x DBOS"][1].startswith("2.75 x")
    assert rows["≥ 3 x Temporal"][1].startswith("2.20 x")  # against the local activity
    assert "best mode: local" in targets(results)[3][0]
    assert rows["share of the no-durability ceiling"][1] == "0.50 x"
    assert rows["p99 intent→succeeded ≤ 25 ms at half the max rate"][2] == "**missed**"
    assert rows["system CPU/op at half rate ÷ at saturation ≤ 1.3"][1].startswith(
        "6.00 ÷ 4.00 = 1.50 x")
    assert rows["peak RSS ≤ 150 MiB per service process"][2] == "met"
    text = render(results, tmp_path)
    assert "| max | 2 | 275.0 (250.0-300.0) | 10.0 (10.0-10.0) |" in text
    assert "| half | 1 | 250.0 | 10.0 | 20.0 | 80.0 | n/a |" not in text  # p99.9 absent here
    assert "| half | 1 | 250.0 | n/a | n/a | 80.0 | n/a |" in text
    assert "## Side by side" in text
    assert "Temporal (dev server), local activity, concurrency 64" in text
    assert "2 process(es)" in text
    assert "Not measured: dbos_direct: not installed" in text


def test_paced_pgbench_log_gives_each_transactions_latency_from_its_schedule() -> None:
    """pgbench's `-R` log counts `time` from the scheduled start, lag included: the lag is not
    added twice, and a failed or skipped transaction is counted, not read as a latency."""
    from effectledger_bench.peers import paced_latencies

    log = ["0 1 3919 0 1796656924 223189 96", "1 1 1595 0 1796656924 223214 95",
           "2 1 skipped 0 1796656924 244415 93", "3 1 failed 0 1796656924 254225 118",
           "", "short line"]
    lat, lag, failed = paced_latencies(log)
    assert lat == [3.919, 1.595] and lag == [0.096, 0.095] and failed == 2


def test_report_puts_the_paced_pgbench_floor_beside_the_half_rate_tail(tmp_path: Path) -> None:
    half = {"scenario": "half", "params": {"rate": 100.0}, "ops_per_s": 100.0,
            "latency_ms": {"p50": 9.0, "p99": 60.0}}
    paced = [{"peer": "pgbench_paced", "rep": r, "rate": 100.0, "ops_per_s": 99.0,
              "latency_ms": {"p50": 4.0 + r, "p99": 40.0 + 10 * r}} for r in range(3)]
    results = {"phases": [half, {**half, "scenario": "max"}],
               "peers": [*paced, {"peer": "pgbench_paced", "rep": 3, "error": "no pgbench"}]}
    rows = {r[0].split(",")[0]: r for r in targets(results)}
    floor = rows["the floor under it: pgbench replaying one operation's SQL at the same rate"]
    assert floor[1] == "50.0 (40.0-60.0) ms (5.0 (4.0-6.0) ms)" and floor[2] == "n/a"
    text = render(results, tmp_path)
    assert "pgbench: one operation's SQL paced at the half rate (100.0/s, rep 2) | 99.0" in text
    assert "pgbench_paced: no pgbench" in text


def test_proc_sampling_reads_this_process() -> None:
    """CPU seconds grow with work; peak RSS is at least the current RSS; gone pids give None."""
    import os

    from effectledger_bench.procs import machine, sample

    before = sample(os.getpid())
    assert before is not None
    sum(i * i for i in range(300_000))  # some CPU work
    after = sample(os.getpid())
    assert after is not None and after.cpu_s >= before.cpu_s
    assert sample(os.getpid(), tree=True) is not None
    assert after.hwm_bytes >= after.rss_bytes > 0
    assert 0 <= after.sys_s <= after.cpu_s
    assert sample(2**22 + 12345) is None
    assert machine()["nproc"] == os.cpu_count()


def test_sql_capture_counts_a_statement_outside_begin_as_its_own_transaction() -> None:
    """The ledger sends a keyed intent's read and its fused writes without BEGIN, each a
    transaction PostgreSQL commits by itself: both belong to the operation's replay."""
    op = "0f0e0d0c0b0a09080706050403020100"
    log = f"""\
2026-11-30 03:22:41.000 UTC [23077] 0 LOG:  execute __asyncpg_stmt_1__: SELECT operations.id \
FROM operations WHERE operations.operation_key = ANY($1::VARCHAR[])
2026-11-30 03:22:41.000 UTC [23077] 0 DETAIL:  parameters: $1 = '{{{KEY}}}'
2026-11-30 03:22:41.001 UTC [23077] 742 LOG:  execute __asyncpg_stmt_2__: WITH w0 AS (INSERT \
INTO operations (id, operation_key) VALUES ($1::VARCHAR, $2::VARCHAR)) INSERT INTO journal \
(operation_id) VALUES ($3::VARCHAR)
2026-11-30 03:22:41.001 UTC [23077] 742 DETAIL:  parameters: $1 = '{op}', $2 = '{KEY}', \
$3 = '{op}'
"""
    ((_op, txns, _ids),) = extract(log, [op]).per_op
    assert [len(t.statements) for t in txns] == [1, 1]
    assert txns[0].text.startswith("SELECT") and f"'{op}'" in txns[1].text
    script = pgbench_script(txns, _ids)
    assert "BEGIN" not in script and script.count("INSERT INTO journal") == 1


def test_wakeups_count_every_thread_that_slept() -> None:
    """A thread of ours that sleeps five times adds at least five wake-ups, counted while it
    is alive (an exited thread takes its count with it).

    The sleeps are the thing measured, not a synchronisation: `time.sleep` always gives up
    the CPU (one voluntary switch each). Waiting on events instead raced: a wait that found
    its event already set never slept, and CI once counted 3 of 5."""
    import os
    import threading
    import time

    from effectledger_bench.procs import sample, self_wakeups

    go, slept, finish = threading.Event(), threading.Event(), threading.Event()

    def sleeper() -> None:
        go.wait()
        for _ in range(5):
            time.sleep(0.001)
        slept.set()
        finish.wait()

    t = threading.Thread(target=sleeper)
    t.start()
    try:
        before, own = sample(os.getpid()), self_wakeups()
        go.set()
        assert slept.wait(5)
        after = sample(os.getpid())
        assert before is not None and after is not None
        assert after.wakeups - before.wakeups >= 5
        assert self_wakeups() - own >= 5
    finally:
        finish.set()
        t.join(5)


def test_writes_count_the_write_syscalls_of_every_thread(tmp_path: Path) -> None:
    """Ten unbuffered writes from another thread of ours add at least ten write syscalls."""
    import os
    import threading

    from effectledger_bench.procs import sample, self_writes

    before, own = sample(os.getpid()), self_writes()

    def writer() -> None:
        with open(tmp_path / "out", "wb", buffering=0) as f:
            for _ in range(10):
                f.write(b"x")

    t = threading.Thread(target=writer)
    t.start()
    t.join(5)
    after = sample(os.getpid())
    assert before is not None and after is not None
    assert after.writes - before.writes >= 10
    assert self_writes() - own >= 10
    assert (tmp_path / "out").read_bytes() == b"x" * 10


def test_preemptions_count_processes_that_share_one_cpu() -> None:
    """Two processes spinning on one CPU take it from each other: each is preempted while
    it could have run on. Each is sampled alive, after its spin (it then waits on stdin)."""
    import os
    import subprocess
    import sys

    from effectledger_bench.procs import sample

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    cpu = min(os.sched_getaffinity(0))
    spin = (f"import os, sys, time; os.sched_setaffinity(0, {{{cpu}}}); "
            "end = time.monotonic() + 0.5\nwhile time.monotonic() < end: pass\n"
            "print('spun', flush=True); sys.stdin.read()")
    procs = [subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "spun\n"
        samples = [sample(p.pid) for p in procs]
    finally:
        for p in procs:
            p.communicate("", timeout=10)
    assert all(s is not None and s.preemptions > 0 for s in samples)


def test_wakeup_probe_reports_each_rate_in_a_fresh_process() -> None:
    from effectledger_bench import wakeprobe

    found = wakeprobe.measure((400, 200))
    assert set(found["rates"]) == {"400", "200"}
    assert found["work_us_hot"] > 0
    for row in found["rates"].values():
        # Every message was handled, each costing at least the work itself
        assert row["cpu_us_per_message"] >= found["work_us_hot"] * 0.5
        assert 0 < row["wakeups_per_message"] <= 3


def test_report_puts_wakeups_beside_the_probe(tmp_path: Path) -> None:
    phase = {"scenario": "max", "params": {}, "ops_per_s": 400.0, "system_cpu_ms_per_op": 3.0,
             "cpu_ms_per_op": {"ledger": 1.0},
             "wakeups_per_op": {"ledger": 0.8, "nats": 5.4, "loadgen": 0.3}}
    half = {**phase, "scenario": "half", "wakeups_per_op": {"ledger": 5.7, "nats": 27.4}}
    probe = {"work_us_hot": 20.0, "rates": {
        "150": {"cpu_us_per_message": 124.6, "wakeups_per_message": 1.01},
        "20000": {"cpu_us_per_message": 31.1, "wakeups_per_message": 0.29}}}
    text = render({"phases": [phase, half], "wakeup_cost": probe}, tmp_path)
    assert "| max | 1 | 0.8 | n/a | n/a | 5.4 | n/a | 0.3 |" in text
    assert "| half | 1 | 5.7 | n/a | n/a | 27.4 | n/a | n/a |" in text
    # Fastest rate first; the last column is the cost over the tight loop's
    assert text.index("| 20,000 | 31.1 | 0.29 | 1.6 |") < text.index("| 150 | 124.6 | 1.01 | 6.2 |")
    assert "Write syscalls per operation" not in text  # a run from before they were counted
    written = render({"phases": [{**phase, "writes_per_op": {"ledger": 1.3, "loadgen": 0.9}},
                                 {**half, "writes_per_op": {"ledger": 4.9}}]}, tmp_path)
    assert "| max | 1 | 1.3 | n/a | n/a | n/a | n/a | 0.9 |" in written
    assert "| half | 1 | 4.9 | n/a | n/a | n/a | n/a | n/a |" in written
    assert "Preemptions per operation" not in written
    preempted = render({"phases": [{**phase, "preemptions_per_op": {"nats": 0.42}}]}, tmp_path)
    assert "| max | 1 | n/a | n/a | n/a | 0.42 | n/a | n/a |" in preempted
    failed = render({"phases": [phase], "wakeup_cost": {"error": "no fork"}}, tmp_path)
    assert "Wake-up probe failed: no fork" in failed


def test_run_queue_wait_counts_the_time_a_process_waited_for_a_cpu() -> None:
    """Two processes that each need 0.2 s of CPU, pinned to one core: while one runs the other
    waits, so their run-queue waits add up to about 0.2 s. A process that is gone reads 0."""
    import os
    import subprocess
    import sys

    from effectledger_bench.procs import _runq_wait, schedstat_kept

    if not schedstat_kept() or not hasattr(os, "sched_setaffinity"):
        pytest.skip("the kernel keeps no scheduler statistics here")
    cpu = min(os.sched_getaffinity(0))
    child = ("import os, time\n"
             "from effectledger_bench.procs import _runq_wait\n"
             "t = time.process_time()\n"
             "while time.process_time() - t < 0.2: pass\n"
             "print(_runq_wait(os.getpid()))\n")
    procs = [subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
             for _ in range(2)]
    waits = [float(p.communicate(timeout=30)[0]) for p in procs]
    assert sum(waits) > 0.1, waits
    assert _runq_wait(2**22 + 12345) == 0.0


def test_report_shows_the_ledgers_writers_per_phase(tmp_path: Path) -> None:
    """Transactions per operation, the mean transaction and how busy the writers were; a run
    from before the figure existed shows no such table."""
    def phase(scenario: str, busy: float) -> dict[str, Any]:
        return {"scenario": scenario, "params": {}, "operations": 1000, "ops_per_s": 300.0,
                "latency_ms": {"p99": 50.0},
                "ledger_stalls": {"writer": {"transactions": 690, "busy_s": 19.7,
                                             "mean_ms": 4.05, "busy_share": busy}}}
    text = render({"phases": [phase("max", 0.9), phase("half", 0.98)], "peers": []}, tmp_path)
    assert "| half | 1 | 0.69 | 4.05 | 0.98 |" in text
    assert "| max | 1 | 0.69 | 4.05 | 0.90 |" in text
    assert "group-commit writers" not in render({"phases": [{**phase("half", 1.0),
                                                             "ledger_stalls": {}}],
                                                 "peers": []}, tmp_path)


def _sweep_phase(share: float, rate: float, p99: float, floor_p99: float | None,
                 idle: float) -> dict[str, Any]:
    return {"scenario": "rate", "params": {"share": share, "rate": rate, "dispatchers": 1},
            "ops_per_s": rate - 1, "latency_ms": {"p50": p99 / 4, "p99": p99},
            "system_cpu_ms_per_op": 3.0, "machine_cpu_share": {"idle": idle},
            **({"floor_ms": {"p50": 4.0, "p99": floor_p99}} if floor_p99 is not None
               else {"floor_ms": {"error": "pgbench logged no transaction"}})}


def test_report_shows_the_rate_sweep_beside_its_floor_per_share(tmp_path: Path) -> None:
    from effectledger_bench.sweep import rows

    phases = [_sweep_phase(0.5, 200.0, 80.0, 20.0, 0.1), _sweep_phase(0.2, 80.0, 12.0, 8.0, 0.6),
              _sweep_phase(0.2, 90.0, 16.0, None, 0.5)]  # a second repetition, no floor
    assert rows(phases) == [
        ["0.2", "85.0 (80.0-90.0)", "84.0 (79.0-89.0)", "3.5 (3.0-4.0)", "14.0 (12.0-16.0)",
         "4.0", "8.0", "3.00 (3.00-3.00)", "45.0 (40.0-50.0)", "2"],
        ["0.5", "200.0", "199.0", "20.0", "80.0", "4.0", "20.0", "3.00", "90.0", "1"]]
    text = render({"phases": phases, "peers": []}, tmp_path)
    assert "## The rate sweep" in text and "| 0.5 | 200.0 | 199.0 | 20.0 | 80.0 |" in text
    assert render({"phases": [], "peers": []}, tmp_path).count("rate sweep") == 0


def test_the_rate_sweep_is_drawn_against_the_offered_rate(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots need the bench extra (matplotlib)")
    from effectledger_bench.sweep import plot

    phases = [_sweep_phase(s, 400 * s, 100 * s, 20 * s, 0.5) for s in (0.2, 0.5)]
    assert plot(phases, tmp_path / "curve-rate.png") == "curve-rate.png"
    assert (tmp_path / "curve-rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


@pytest.mark.parametrize(("given", "shares"), [("0.5,0.2", [0.2, 0.5]), ("0.35", [0.35]),
                                               ("0.2,0.2,1.5", [0.2, 1.5])])
def test_rates_are_shares_of_the_max_rate(given: str, shares: list[float]) -> None:
    import argparse

    from effectledger_bench.cli import add_arguments, build_config

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    cfg = build_config(ap.parse_args(["--quick", "--rates", given, "--out", "x"]))
    assert cfg.rate_shares == shares  # type: ignore[attr-defined]
    assert build_config(ap.parse_args(["--quick", "--out", "x"])).rate_shares == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("given", ["0", "-0.2", "2", "half", ","])
def test_a_share_outside_the_max_rate_is_refused_clearly(
        given: str, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from effectledger_bench.cli import add_arguments

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    with pytest.raises(SystemExit):
        ap.parse_args(["--rates", given])
    assert "--rates" in capsys.readouterr().err
