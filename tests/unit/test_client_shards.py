"""Provider calls are spread over several small connection pools (provider.make_clients)."""

from __future__ import annotations

from typing import Any

from effectledger_core.catalog import Catalog
from effectledger_core.config import DEMO_CATALOG
from effectledger_core.subjects import Subjects
from effectledger_dispatcher.provider import make_clients
from effectledger_dispatcher.worker import Dispatcher


async def test_make_clients_covers_the_total_with_small_pools() -> None:
    clients = make_clients(130, per_client=8)
    try:
        assert len(clients) == 17  # ceil(130 / 8)
        assert len({id(c) for c in clients}) == 17
    finally:
        for c in clients:
            await c.aclose()


def test_dispatcher_takes_the_pools_in_turn() -> None:
    pools: list[Any] = ["a", "b", "c"]
    d = Dispatcher(nc=None, http="only", http_pool=pools,  # type: ignore[arg-type]
                   catalog=Catalog.load(DEMO_CATALOG), subjects=Subjects(prefix="t"),
                   dispatcher_id="d1", env={})
    assert [d._client() for _ in range(6)] == ["b", "c", "a", "b", "c", "a"]
    alone = Dispatcher(nc=None, http="only", catalog=Catalog.load(DEMO_CATALOG),  # type: ignore[arg-type]
                       subjects=Subjects(prefix="t"), dispatcher_id="d1", env={})
    assert alone._client() == "only"
