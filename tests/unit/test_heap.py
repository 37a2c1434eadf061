"""Long-lived objects are frozen out of the garbage collector's full passes (core/heap.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from effectledger_cli.main import run_loop
from effectledger_core.heap import freeze_long_lived


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session keeps its ordinary collector


def test_freezing_takes_every_object_out_of_the_collectors_walk() -> None:
    assert gc.get_freeze_count() == 0
    kept = [object() for _ in range(10)]  # noqa: F841 - objects that exist when freezing
    frozen = freeze_long_lived()
    assert frozen == gc.get_freeze_count() > 1000  # the interpreter's own objects and ours
    # What is made afterwards is still collected: a cycle is freed by the next collection.
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


def test_a_service_loop_starts_with_its_imports_frozen() -> None:
    seen: list[int] = []

    async def service() -> None:
        seen.append(gc.get_freeze_count())

    run_loop(service())
    assert seen and seen[0] > 1000
