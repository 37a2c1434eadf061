"""Long-lived objects are frozen out of the garbage collector's full passes (core/heap.py)."""

from __future__ import annotations

import asyncio
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


async def test_a_growing_process_freezes_what_survives_each_full_collection() -> None:
    from effectledger_core.heap import freeze_survivors_of_full_collections

    before = list(gc.callbacks)
    loop = asyncio.get_running_loop()
    freeze_survivors_of_full_collections(loop.call_soon_threadsafe)
    try:
        assert gc.get_freeze_count() == 0
        gc.collect(1)  # not a full collection: nothing is scheduled
        turn: asyncio.Future[None] = loop.create_future()
        loop.call_soon(turn.set_result, None)  # runs after anything scheduled before it
        await turn
        assert gc.get_freeze_count() == 0
        gc.collect()  # a full one: its survivors are frozen on the loop's next turn
        turn = loop.create_future()
        loop.call_soon(turn.set_result, None)
        await turn
        assert gc.get_freeze_count() > 1000
    finally:
        gc.callbacks[:] = before
