"""Provider calls are spread over several small connection pools (`calls.make_clients`)."""

from __future__ import annotations

from typing import Any

import pytest

from effectledger_dispatcher.ports import HttpProviderCaller
from effectledger_providers.calls import make_clients


async def test_make_clients_covers_the_total_with_small_pools() -> None:
    clients = make_clients(130, per_client=8)
    try:
        assert len(clients) == 17  # ceil(130 / 8)
        assert len({id(c) for c in clients}) == 17
    finally:
        for c in clients:
            await c.aclose()


def test_provider_calls_take_the_pools_in_turn() -> None:
    pools: list[Any] = ["a", "b", "c"]
    caller = HttpProviderCaller(pools, env={})
    assert [caller.client() for _ in range(6)] == ["b", "c", "a", "b", "c", "a"]
    alone = HttpProviderCaller(["only"], env={})  # type: ignore[list-item]
    assert alone.client() == "only"


def test_a_caller_needs_a_client() -> None:
    with pytest.raises(ValueError, match="at least one"):
        HttpProviderCaller([], env={})
