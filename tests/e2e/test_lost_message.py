"""JetStream loses a dispatch command: the ledger's sweeper notices and republishes it."""

from __future__ import annotations

from typing import Any

import nats
import pytest

from tests.support.cluster import Cluster, wait_until


@pytest.mark.slow
async def test_a_lost_dispatch_command_is_republished_by_the_sweeper(make_cluster: Any) -> None:
    """A published command deleted from the stream (as a broker crash could) is republished
    once it stays unclaimed past sweep_after; the operation then succeeds, applied once.

    The first ledger never sweeps (sweep_after of an hour), so the loss is staged without a
    race; the restarted ledger sweeps after one second.
    """
    c: Cluster = make_cluster()
    subjects = c.settings.subjects
    await c.start_sandbox()
    await c.start_ledger(env={"EFFECTLEDGER_SWEEP_AFTER_S": "3600"})
    op = await c.submit_ok("create_ticket", {"title": "lost"}, key="lost-message")

    async def published() -> bool:
        return bool((await c.stats())["outbox"] == {"published": 1})

    await wait_until(published, 30, what="the outbox row to be published")

    nc = await nats.connect(c.settings.nats_url)
    try:
        js = nc.jetstream()
        msg = await js.get_last_msg(subjects.dispatch_stream, subjects.dispatch("create_ticket"))
        assert msg.headers and msg.headers.get("Nats-Msg-Id"), msg.headers
        assert msg.data is not None and op["id"].encode() in msg.data
        assert msg.seq is not None
        assert await js.delete_msg(subjects.dispatch_stream, msg.seq)
    finally:
        await nc.close()
    assert await c.stream_messages(subjects.dispatch_stream) == 0

    # The dispatcher starts on an empty stream: nothing will reach it unless the ledger acts.
    await c.start_dispatcher()
    await c.stop("ledger")
    await c.start_ledger(env={"EFFECTLEDGER_SWEEP_AFTER_S": "1",
                              "EFFECTLEDGER_SWEEP_INTERVAL_S": "0.2"})

    await c.wait_state(op["id"], "succeeded", 60)
    journal = await c.journal(op["id"])
    kinds = [e["kind"] for e in journal]
    assert kinds == ["intent_accepted", "dispatch_republished", "attempt_claimed",
                     "outcome_recorded"], kinds
    republished = journal[1]
    assert republished["actor"] == "ledger.sweeper" and republished["detail"]["generation"] == 1
    assert (await c.stats())["outbox"] == {"consumed": 1}
    truth = await c.key_truth(op["operation_key"])
    assert truth["requests"] == 1 and truth["applied"] == 1, truth
