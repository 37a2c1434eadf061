"""The agent's path takes the one-statement calls (docs/design.md, "A call alone: one
statement"): through the real ledger and dispatcher on PostgreSQL, an operation submitted
with a caller key, one at a time, is created, claimed and recorded by one statement each, and
the same key again is declined by it and answered by the read it falls back to.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.test_observability_e2e import _scrape, total
from tests.support.cluster import Cluster, wait_until

pytestmark = [pytest.mark.parametrize("db_url", ["postgres"], indirect=True)]


async def test_one_call_at_a_time_is_one_statement_per_transaction(make_cluster: Any) -> None:
    c: Cluster = make_cluster()
    await c.start_sandbox()
    await c.start_ledger()
    await c.start_dispatcher()
    before = await _scrape(f"{c.ledger_url}/metrics")  # the warm-up rehearses them too
    ops = []
    for i in range(3):  # one at a time, as an agent calls
        ops.append(await c.submit_ok("create_ticket", {"title": f"t{i}"}, key=f"k{i}"))
        await c.wait_state(ops[-1]["id"], "succeeded", 30)
    again = await c.submit("create_ticket", {"title": "t0"}, key="k0")
    assert again.status_code == 200 and again.json()["id"] == ops[0]["id"], again.text

    async def stray_refused() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        # The retry's statement declined after its command went out with it (docs/design.md,
        # "A command published with its commit"): a command for an operation never created,
        # whose claim is not found three times, each declined by the one statement first.
        scraped = await _scrape(f"{c.ledger_url}/metrics")
        found = total(scraped, "effectledger_claims_total", status="not_found")
        return scraped if found == 3 else None

    scraped = await wait_until(stray_refused, 20, what="the retry's command refused")

    def alone(call: str, result: str) -> float:
        return (total(scraped, "effectledger_db_alone_total", call=call, result=result)
                - total(before, "effectledger_db_alone_total", call=call, result=result))

    # One at a time, each call is alone in its transaction (group commit has nothing to add).
    assert alone("intent", "written") == 3 and alone("intent", "declined") == 1
    assert alone("claim", "written") == 3 and alone("claim", "declined") == 3
    assert alone("outcome", "written") == 3 and alone("outcome", "declined") == 0
