"""The open-loop generator's own lateness, as the benchmark reports it beside the tail."""

from __future__ import annotations

import gc

from effectledger_bench.load import LoadResult, _collections


def test_send_lag_is_summarised_with_the_sends_over_5_ms() -> None:
    result = LoadResult("t", "open@100/s", submitted=100, wall_s=1.0,
                        send_lag_ms=[0.1] * 97 + [6.0, 40.0, 120.0])
    out = result.to_json()
    # Nearest rank, as every other percentile of the report: p99 of 100 sends is the 99th.
    assert out["send_lag_ms"] == {"p50": 0.1, "p99": 40.0, "max": 120.0, "over_5ms": 3}
    assert out["generator_gc_ms"] == {"count": 0, "max": 0.0}


def test_a_closed_loop_has_no_lag_figures() -> None:
    assert "send_lag_ms" not in LoadResult("t", "closed@window=8").to_json()


def test_full_collections_of_this_process_are_timed_and_only_those() -> None:
    pauses: list[float] = []
    with _collections(pauses):
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    gc.collect(2)  # after the block: not counted
    assert len(pauses) == 2 and all(p >= 0.0 for p in pauses)
