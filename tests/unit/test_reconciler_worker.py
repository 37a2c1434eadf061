"""The reconciler's consumer with fakes: what it acks, naks, publishes and dead-letters.

Fakes, not mocks: the edge's delivery, ledger and publisher fakes (effectledger_bus.testing),
and a provider whose effect appears at a chosen time of a fake clock.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from effectledger_bus.testing import FakeDelivery, FakeLedger, FakePublisher
from effectledger_core.catalog import Catalog, Tool
from effectledger_core.messages import (
    DeadLetter,
    ReconcileOperation,
    VerdictReached,
    encode,
    parse,
)
from effectledger_core.readbacks import ReadbackResult
from effectledger_core.states import State
from effectledger_core.subjects import Subjects
from effectledger_obs import logs, tracing
from effectledger_providers.testing import FakeProviderClient
from effectledger_reconciler.decisions import OperationView, Timing
from effectledger_reconciler.ledger_client import LedgerUnavailable, parse_operation_reply
from effectledger_reconciler.worker import Reconciler, http_readback

T0 = datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)
SUBJECTS = Subjects(prefix="t", stream_prefix="T")
CATALOG = Catalog.from_mapping({"tools": {
    "rb": {"endpoint": "http://provider/v1/x/effects", "contract_revision": "1",
           "horizon_s": 10, "capabilities": {"readback": True},
           "readback": {"url": "http://provider/v1/x/effects/by-key/{operation_key}"},
           "headers": {"Authorization": "Bearer ${RB_KEY}"}},
    "hook": {"endpoint": "http://provider/v1/x/effects", "contract_revision": "1",
             "capabilities": {"webhooks": True}, "webhook_provider": "sandbox"},
    "blind": {"endpoint": "http://provider/v1/x/effects", "contract_revision": "1"},
}})
TIMING = Timing(reconcile_deadline_s=600.0, webhook_wait_s=30.0)


class FakeClock:
    def __init__(self, start: datetime = T0 + timedelta(seconds=6)) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def delivery(data: bytes, deliveries: int = 1) -> FakeDelivery:
    return FakeDelivery(data, deliveries, subject="t.reconcile.v1.ambiguous")


class FakeProvider:
    def __init__(self, clock: FakeClock, applies_at: float | None = None) -> None:
        self.clock = clock
        self.applies_at = applies_at
        self.error: str | None = None
        self.calls = 0
        self.delay_s = 0.0

    async def readback(self, tool: Tool, cmd: ReconcileOperation) -> ReadbackResult:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.error is not None:
            return ReadbackResult(None, error=self.error)
        elapsed = (self.clock() - T0).total_seconds()
        if self.applies_at is not None and elapsed >= self.applies_at:
            return ReadbackResult(True, provider_ref="eff_9", evidence_digest="sha256:f0",
                                  http_status=200)
        return ReadbackResult(False, evidence_digest="sha256:0f", http_status=404)


def command(tool: str = "rb", epoch: int = 1, **extra: Any) -> ReconcileOperation:
    return ReconcileOperation(operation_id="op1", epoch=epoch, attempt_id="a1",
                              operation_key="ck_1", tool=tool, arguments={}, cause="ambiguous",
                              claimed_at=T0, noticed_at=T0 + timedelta(seconds=6), **extra)


@dataclass
class World:
    clock: FakeClock
    ledger: FakeLedger[OperationView]
    publisher: FakePublisher
    provider: FakeProvider
    reconciler: Reconciler

    def verdicts(self) -> list[VerdictReached]:
        return [parse(VerdictReached, p) for p, _ in self.publisher.on(SUBJECTS.verdict)]


@pytest.fixture
def world() -> World:
    clock = FakeClock()
    ledger = FakeLedger({"op1": OperationView(id="op1", state=State.AMBIGUOUS, epoch=1)}, now=T0)
    publisher = FakePublisher()
    provider = FakeProvider(clock)
    reconciler = Reconciler(ledger=ledger, publisher=publisher, catalog=CATALOG,
                            subjects=SUBJECTS, reconciler_id="rec-1", readback=provider.readback,
                            timing=TIMING, clock=clock, publish_retry_s=0.001)
    return World(clock, ledger, publisher, provider, reconciler)


async def test_a_tool_without_oracles_gets_an_undecidable_verdict_then_the_ack(
        world: World) -> None:
    d = delivery(encode(command("blind")))
    await world.reconciler.handle(d)
    assert d.acked and not d.naks
    [(payload, msg_id)] = world.publisher.on(SUBJECTS.verdict)
    verdict = parse(VerdictReached, payload)
    assert msg_id == "verdict:op1:1:undecidable"
    assert (verdict.operation_id, verdict.epoch, verdict.verdict) == ("op1", 1, "undecidable")
    assert verdict.reason == "no readback or webhook oracle"
    assert verdict.reconciler_id == "rec-1" and verdict.at == world.clock()


async def test_readback_found_publishes_applied_with_the_evidence(world: World) -> None:
    world.provider.applies_at = 1.0
    d = delivery(encode(command()))
    await world.reconciler.handle(d)
    assert d.acked
    [verdict] = world.verdicts()
    assert verdict.verdict == "applied" and verdict.evidence is not None
    assert (verdict.evidence.source, verdict.evidence.provider_ref, verdict.evidence.digest) \
        == ("readback", "eff_9", "sha256:f0")
    assert world.publisher.on(SUBJECTS.verdict)[0][1] == "verdict:op1:1:applied"


async def test_late_apply_waits_by_nak_and_ends_applied_never_not_applied(
        world: World) -> None:
    """Not found before the horizon → nak(delay); the effect appears at 8 s → applied."""
    world.provider.applies_at = 8.0
    deliveries = 0
    while not world.verdicts():
        deliveries += 1
        d = delivery(encode(command()), deliveries=deliveries)
        await world.reconciler.handle(d)
        if d.naks:
            assert not d.acked
            world.clock.advance(d.naks[-1])
        assert deliveries < 50
    assert [v.verdict for v in world.verdicts()] == ["applied"]
    assert deliveries > 1 and world.provider.calls == deliveries


async def test_never_applied_is_not_applied_after_the_horizon(world: World) -> None:
    deliveries = 0
    while not world.verdicts():
        deliveries += 1
        d = delivery(encode(command()), deliveries=deliveries)
        await world.reconciler.handle(d)
        for delay in d.naks:
            world.clock.advance(delay)
    [verdict] = world.verdicts()
    assert verdict.verdict == "not_applied"
    assert (world.clock() - T0).total_seconds() >= 10.0


async def test_webhook_tool_rechecks_the_ledger_each_delivery_and_stops_once_decided(
        world: World) -> None:
    d = delivery(encode(command("hook")))
    await world.reconciler.handle(d)
    assert d.naks and not d.acked and world.ledger.reads == 1
    # Meanwhile the ledger applied a webhook: the next delivery just acks.
    world.ledger.operations["op1"] = OperationView(id="op1", state=State.SUCCEEDED, epoch=1)
    d = delivery(encode(command("hook")), deliveries=2)
    await world.reconciler.handle(d)
    assert d.acked and not world.publisher.messages and world.ledger.reads == 2


async def test_webhook_only_tool_needs_review_after_the_wait(world: World) -> None:
    world.clock.advance(30.0)
    d = delivery(encode(command("hook")), deliveries=9)
    await world.reconciler.handle(d)
    [verdict] = world.verdicts()
    assert verdict.verdict == "undecidable" and "webhook" in verdict.reason and d.acked


@pytest.mark.parametrize("op", [OperationView(id="op1", state=State.AMBIGUOUS, epoch=2),
                                OperationView(id="op1", state=State.SUCCEEDED, epoch=1),
                                OperationView(id="op1", state=State.NEEDS_REVIEW, epoch=1)])
async def test_stale_or_decided_commands_are_acked_without_work(world: World,
                                                                op: OperationView) -> None:
    world.ledger.operations["op1"] = op
    d = delivery(encode(command()))
    await world.reconciler.handle(d)
    assert d.acked and not world.publisher.messages and world.provider.calls == 0


async def test_ledger_unavailable_naks_with_backoff_and_publishes_nothing(world: World) -> None:
    world.ledger.down = LedgerUnavailable("operation read: TimeoutError")
    d = delivery(encode(command()), deliveries=3)
    await world.reconciler.handle(d)
    assert d.naks == [2.0] and not d.acked and not world.publisher.messages


async def test_a_verdict_that_cannot_be_stored_is_not_acked(world: World) -> None:
    world.publisher.failures = 99
    d = delivery(encode(command("blind")))
    await world.reconciler.handle(d)
    assert not d.acked and d.naks and not world.publisher.messages


async def test_a_transient_publish_failure_is_retried_before_the_ack(world: World) -> None:
    world.publisher.failures = 1
    d = delivery(encode(command("blind")))
    await world.reconciler.handle(d)
    assert d.acked and len(world.verdicts()) == 1


async def test_two_replicas_deciding_the_same_epoch_store_one_verdict(world: World) -> None:
    other = Reconciler(ledger=world.ledger, publisher=world.publisher, catalog=CATALOG,
                       subjects=SUBJECTS, reconciler_id="rec-2",
                       readback=world.provider.readback, timing=TIMING, clock=world.clock)
    a, b = delivery(encode(command("blind"))), delivery(encode(command("blind")), 2)
    await asyncio.gather(world.reconciler.handle(a), other.handle(b))
    assert a.acked and b.acked and len(world.verdicts()) == 1


@pytest.mark.parametrize("raw", [b"not json", b'{"type": "reconcile_operation"}',
                                 encode(command()).replace(b'"epoch":1', b'"epoch":0')])
async def test_poison_commands_are_dead_lettered_and_acked(world: World, raw: bytes) -> None:
    d = delivery(raw, deliveries=2)
    await world.reconciler.handle(d)
    assert d.acked
    [(payload, _)] = world.publisher.on(SUBJECTS.deadletter)
    letter = parse(DeadLetter, payload)
    assert letter.consumer == "reconciler" and letter.message_id == "outbox-1"
    assert letter.deliveries == 2 and letter.payload_excerpt == raw.decode(errors="replace")


async def test_an_operation_unknown_to_the_ledger_is_dead_lettered(world: World) -> None:
    world.ledger.operations.clear()
    d = delivery(encode(command()))
    await world.reconciler.handle(d)
    assert d.acked and not world.verdicts()
    [(payload, _)] = world.publisher.on(SUBJECTS.deadletter)
    assert "does not know" in parse(DeadLetter, payload).error


async def test_a_dead_letter_that_cannot_be_stored_is_not_acked(world: World) -> None:
    world.publisher.failures = 99
    d = delivery(b"garbage")
    await world.reconciler.handle(d)
    assert not d.acked and d.naks


async def test_an_unexpected_error_naks_instead_of_losing_the_command(world: World) -> None:
    async def broken(tool: Tool, cmd: ReconcileOperation) -> ReadbackResult:
        raise RuntimeError("adapter bug")

    world.reconciler.readback = broken
    d = delivery(encode(command()))
    await world.reconciler.handle(d)
    assert not d.acked and d.naks and not world.publisher.messages


async def test_a_slow_readback_sends_in_progress_heartbeats(world: World) -> None:
    world.reconciler.ack_wait_s = 0.06
    world.provider.delay_s = 0.1
    world.provider.applies_at = 0.0
    d = delivery(encode(command()))
    await world.reconciler.handle(d)
    assert d.acked and d.beats >= 2


# -- the real readback through the dispatcher's provider code --------------------------------

async def test_http_readback_maps_the_provider_answer() -> None:
    seen: list[httpx.Request] = []

    def provider(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/ck_1"):
            return httpx.Response(200, json={"id": "eff_3"})
        if request.url.path.endswith("/ck_2"):
            return httpx.Response(404, json={})
        return httpx.Response(500)

    async with FakeProviderClient(provider) as client:
        run = http_readback(client, {"RB_KEY": "sekrit"})
        tool = CATALOG.get("rb")
        found = await run(tool, command())
        absent = await run(tool, command().model_copy(update={"operation_key": "ck_2"}))
        broken = await run(tool, command().model_copy(update={"operation_key": "ck_3"}))
    assert (found.found, found.provider_ref, found.http_status) == (True, "eff_3", 200)
    assert found.evidence_digest is not None and found.evidence_digest.startswith("sha256:")
    assert (absent.found, absent.http_status) == (False, 404)
    assert broken.found is None and broken.error
    assert seen[0].headers["authorization"] == "Bearer sekrit"


# -- the ledger's rpc_operation reply ----------------------------------------------------------

def test_operation_reply_parsing() -> None:
    ok = {"ok": True, "operation": {"id": "op1", "state": "ambiguous", "epoch": 3,
                                    "operation_key": "k", "tool": "rb", "provider_ref": None}}
    view = parse_operation_reply(json.dumps(ok).encode())
    assert view == OperationView(
        id="op1", state=State.AMBIGUOUS, epoch=3, operation_key="k", tool="rb")
    assert view is not None and view.state is State.AMBIGUOUS  # the core's member, not a string
    missing = {"ok": False, "error": {"code": "not_found", "message": "no such operation"}}
    assert parse_operation_reply(json.dumps(missing).encode()) is None
    for bad in (b"nope", b"[]", b'{"ok": true}', b'{"ok": true, "operation": {"id": "x"}}',
                b'{"ok": true, "operation": {"id": "x", "state": "a", "epoch": true}}',
                # A state this reconciler does not know: nothing is decided on it.
                b'{"ok": true, "operation": {"id": "x", "state": "vanished", "epoch": 1}}',
                b'{"ok": false, "error": {"code": "store_unavailable"}}', b'{"ok": false}'):
        with pytest.raises(LedgerUnavailable):
            parse_operation_reply(bad)


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """The services' JSON log lines at INFO, as a deployment writes them; tracing on."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    logs.configure_logging("INFO", "json", stream=out)
    tracing.configure_tracing("test", exporter=InMemorySpanExporter())
    yield out
    tracing.shutdown_tracing()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


async def test_a_wait_is_logged_once_when_it_starts_and_once_when_it_is_decided(
        world: World, json_logs: io.StringIO) -> None:
    world.provider.applies_at = 8.0  # not found for a few redeliveries, then found
    deliveries = 0
    trace_ids = set()
    while not world.verdicts():
        deliveries += 1
        d = delivery(encode(command()), deliveries=deliveries)
        with tracing.span("consume reconcile") as span:  # as the bus's consumer does
            assert span is not None
            trace_ids.add(format(span.get_span_context().trace_id, "032x"))
            await world.reconciler.handle(d)
        for delay in d.naks:
            world.clock.advance(delay)
        assert deliveries < 50
    assert deliveries > 2  # several redeliveries, yet only two lines
    lines = [json.loads(line) for line in json_logs.getvalue().splitlines()]
    mine = [line for line in lines if line["logger"] == "effectledger_reconciler.worker"]
    assert [line["message"].split(":")[1].strip().split(" ")[0] for line in mine] == [
        "waiting", "verdict"]
    start, decided = mine
    assert start["message"].startswith("reconcile: waiting")
    assert decided["message"].startswith("reconcile: verdict applied")
    assert f"after {deliveries - 1} wait(s)" in decided["message"]
    for line in mine:
        assert (line["operation_id"], line["epoch"], line["attempt_id"], line["tool"]) == (
            "op1", 1, "a1", "rb")
        assert line["level"] == "INFO" and line["trace_id"] in trace_ids
    # Decided: a later command for the same epoch starts a new wait line, not a stale count.
    assert world.reconciler._waiting == {}
