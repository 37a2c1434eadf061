"""A real stack for the framework integrations' tests (tests/e2e/test_integration_*.py): the sandbox
provider, the ledger, a dispatcher and the reconciler as processes (`Cluster`), a typed client
on the ledger, and the sandbox's ground truth of how many effects were really applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from effectledger_client import AsyncClient
from tests.support.cluster import Cluster


async def start(make_cluster: Callable[..., Cluster]) -> Cluster:
    """The pipeline with a reconciler, so that an unknown outcome settles (`needs_review` for a
    tool with no oracle) while the test goes on."""
    c = make_cluster()
    await c.start()
    await c.start_reconciler()
    return c


def client(c: Cluster) -> AsyncClient:
    # The test ledger runs without tokens: the agent is the default tenant's.
    return AsyncClient(c.ledger_url, token="", timeout_s=30.0)


async def applied(c: Cluster) -> int:
    """Effects the provider really applied so far, whatever anyone was told."""
    return int((await c.truth())["total_applied"])


async def operations(c: Cluster) -> int:
    return sum((await c.stats())["operations"].values())


async def fault(c: Cluster, route: str, action: dict[str, Any]) -> None:
    """The sandbox's next request on `route` meets `action` (e.g. `drop_after_apply`: the
    effect is applied and the answer lost)."""
    resp = await c.sandbox.post("/_faults/append", json={
        "match": {"route": route}, "action": action, "times": 1})
    assert resp.status_code == 200, resp.text
