"""`effectledger_bench.instructions`: the count read from valgrind's log, the figure per
operation, and the stack running a service under a wrapper command."""

from __future__ import annotations

from pathlib import Path

import pytest

from effectledger_bench.instructions import collected, per_operation
from effectledger_bench.stack import Stack

LOG = """==4242== Callgrind, a call-graph generating cache profiler
==4242== Events    : Ir
==4242== Collected : 5556372057
==4242==
==4242== I   refs:      5,556,372,057
"""


def test_the_count_is_read_from_the_callgrind_log() -> None:
    assert collected(LOG) == 5_556_372_057


def test_a_log_without_a_count_is_an_error_that_shows_the_log() -> None:
    with pytest.raises(RuntimeError, match="valgrind: Bad option"):
        collected("valgrind: Bad option: --tool=callgrnd\n")


def test_per_operation_is_the_slope_so_start_up_and_shutdown_cancel_out() -> None:
    start_up = 5_500_000_000
    assert per_operation({50: start_up + 50 * 2_300_000, 250: start_up + 250 * 2_300_000}) \
        == pytest.approx(2_300_000)
    # Three counts: the least-squares slope, not the last pair's.
    assert per_operation({10: 1_000, 20: 2_100, 30: 2_900}) == pytest.approx(95.0)


def test_one_n_gives_no_figure() -> None:
    with pytest.raises(ValueError):
        per_operation({50: 1})


def test_a_service_runs_under_its_kind_s_wrapper(tmp_path: Path) -> None:
    # `env NAME=1 python -m effectledger_cli sandbox`: the variable in the process proves the
    # wrapper ran it (the sandbox needs neither the database nor NATS named here).
    stack = Stack(tmp_path, database_url="postgresql://unused", nats_url="nats://unused",
                  wrappers={"sandbox": ["env", "EFFECTLEDGER_BENCH_WRAPPED=1"]})
    stack.catalog_path = tmp_path / "catalog.toml"  # start_infra's, which this test skips
    try:
        stack.start_sandbox()
        pid = stack.services["sandbox"].pid
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"EFFECTLEDGER_BENCH_WRAPPED=1" in environ
    finally:
        stack.close()
