"""Replies only to inboxes (issue 28), against a real nats-server with the generated
least-privilege users and a real ledger process: agent acme sends legal requests (intents,
reads, waits) whose reply subject is a stream subject (dispatch, reconcile, verdict, webhook),
the JetStream API (`$JS.API.STREAM.PURGE/DELETE/INFO …`) or another user's inbox. Before, the
ledger answered every one of them where it was told (300 requests: 300 junk messages in the
dispatch stream). Now nothing lands anywhere, no work is done for them (no operation), the
ledger counts them, and a legal request with acme's own inbox still gets its answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from effectledger_bus import permissions
from effectledger_core.config import Settings
from tests.support.cluster import Cluster, wait_until
from tests.support.natsauth import PrivateBroker, private_broker, speaker

OBSERVER = "operator-observer"  # may read every subject: sees whatever would land anywhere
ROUNDS = 10


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
async def broker(settings: Settings, tmp_path: Path) -> AsyncIterator[PrivateBroker]:
    observer = permissions.Principal(permissions.Role.OPERATOR, OBSERVER,
                                     permissions.Permissions(publish=(">",), subscribe=(">",)))
    with private_broker(tmp_path, settings.subjects, others=[observer]) as b:
        yield b


@pytest.fixture
async def ledger(broker: PrivateBroker, make_cluster: Callable[..., Cluster]) -> Cluster:
    """The ledger alone (no dispatcher): whatever enters the dispatch stream stays there."""
    c = make_cluster(env={"EFFECTLEDGER_NATS_URL": broker.url})
    await c.start_ledger(env=broker.env("ledger"))
    return c


async def _stream_counts(nc: Any, broker: PrivateBroker) -> dict[str, int]:
    js = nc.jetstream()
    s = broker.subjects
    return {name: int((await js.stream_info(name)).state.messages)
            for name in (s.dispatch_stream, s.events_stream)}


async def _refused_count(c: Cluster) -> float:
    text = (await c.ledger.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("effectledger_rpc_replies_refused_total{"))


async def test_replies_go_only_to_the_requesters_own_inbox(
        ledger: Cluster, broker: PrivateBroker) -> None:
    s = broker.subjects
    targets = [s.dispatch("fast_ticket"), s.ambiguous, s.verdict, s.webhook,
               s.outcome_by("dispatcher", "attempt_succeeded"),
               f"$JS.API.STREAM.PURGE.{s.dispatch_stream}",
               f"$JS.API.STREAM.DELETE.{s.events_stream}",
               f"$JS.API.STREAM.INFO.{s.dispatch_stream}",
               "_INBOX_agent-globex.stolen.1", "_INBOX_operator.stolen.1", "_INBOX.stolen.1"]
    observer = broker.files.credentials[OBSERVER]
    seen: list[tuple[str, bytes]] = []

    async def record(msg: Any) -> None:
        seen.append((msg.subject, msg.data))

    spy = await nats.connect(broker.url, user=observer.user, password=observer.password,
                             inbox_prefix=permissions.inbox_prefix(OBSERVER).encode())
    try:
        before = await _stream_counts(spy, broker)
        for target in targets:
            # The ledger (its sweeper) and this spy read stream info themselves; `$JS.API.>`
            # carries the ledger's own consumer traffic: every other target is watched.
            if ".STREAM.INFO." not in target:
                await spy.subscribe(target, cb=record)
        await spy.flush()
        refused_before = await _refused_count(ledger)
        sent = 0
        async with speaker(broker, "agent-acme") as acme:
            for n in range(ROUNDS):
                requests: list[tuple[str, dict[str, Any]]] = [
                    (s.rpc_intents_for("acme"), {"tool": "fast_ticket", "arguments": {"n": 1},
                                                 "idempotency_key": f"reply-attack-{n}"}),
                    (s.rpc_operation_for("acme"), {"operation_id": "reply-attack-op"}),
                    (s.rpc_operation_wait_for("acme"), {"operation_id": "reply-attack-op",
                                                        "wait_s": 0})]
                for target in targets:
                    for subject, body in requests:
                        await acme.nc.publish(subject, json.dumps(body).encode(),
                                              reply=target)
                        sent += 1
            await acme.nc.flush()
            # The legal request after them, answered in acme's own inbox.
            reply = await acme.request(s.rpc_intents_for("acme"),
                                       {"tool": "fast_ticket", "arguments": {"n": 2},
                                        "idempotency_key": "legit"})
            assert reply["ok"] is True, reply
            assert acme.errors == [], acme.errors

        async def all_counted() -> bool:
            return await _refused_count(ledger) - refused_before >= sent

        await wait_until(all_counted, 30, what=f"the ledger to count {sent} refused replies")

        async def legit_dispatched() -> bool:
            counts = await _stream_counts(spy, broker)
            return counts[s.dispatch_stream] > before[s.dispatch_stream]

        await wait_until(legit_dispatched, 30, what="the legal intent's dispatch command")
        # Messages sent before the server's answer to a ping are delivered before it.
        await spy.flush()
        await asyncio.sleep(0)  # let the callbacks of what was delivered run
        # The one command of the legal intent, and nothing else: no junk, nothing purged.
        assert [(subject, json.loads(data).get("operation_id")) for subject, data in seen] == [
            (s.dispatch("fast_ticket"), reply["operation"]["id"])], seen[:5]
        after = await _stream_counts(spy, broker)
        assert after[s.dispatch_stream] == before[s.dispatch_stream] + 1
        assert after[s.events_stream] == before[s.events_stream]
    finally:
        await spy.close()
    # Refused before any work: none of the attack intents became an operation.
    rows = await ledger.db_rows("SELECT caller_key FROM operations ORDER BY caller_key")
    assert [r["caller_key"] for r in rows] == ["legit"]
    assert await _refused_count(ledger) - refused_before == sent
