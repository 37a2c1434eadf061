"""FastStream's `LedgerRouter` in FastStream's own in-memory test broker (`TestNatsBroker`),
against a fake ledger that answers on the tenant's intent and wait subjects as the real one does
(the real one: tests/e2e/test_integration_faststream.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("faststream", reason="faststream is not installed: pip install -e "
                    "'.[integrations]'")

from faststream.nats import NatsBroker, TestNatsBroker

from effectledger_core.messages import (
    ErrorDetail,
    ErrorReply,
    IntentReply,
    OperationReply,
    OperationSummary,
    OperationWait,
    SubmitIntent,
)
from effectledger_core.subjects import Subjects
from effectledger_integrations.faststream import LedgerRefused, LedgerRouter
from tests.support.cluster import wait_until

SUBJECTS = Subjects(prefix="fx")


class FakeLedger:
    """Answers intents (one operation per key) and waits (each operation's states in turn,
    the last one repeated)."""

    def __init__(self, broker: NatsBroker, *states: str) -> None:
        self.states = states
        self.intents: list[SubmitIntent] = []
        self.waits: list[OperationWait] = []
        self.keys: dict[str, str] = {}

        @broker.subscriber(SUBJECTS.rpc_intents_for("acme"))
        async def intents(intent: SubmitIntent) -> IntentReply | ErrorReply:
            self.intents.append(intent)
            if intent.tenant != "acme":  # as the real ledger: the subject's tenant only
                return ErrorReply(error=ErrorDetail(code="invalid_request",
                                                    message="tenant differs"))
            if intent.tool == "nope":
                return ErrorReply(error=ErrorDetail(code="invalid_request",
                                                    message="unknown tool 'nope'"))
            known = intent.idempotency_key in self.keys
            op_id = self.keys.setdefault(str(intent.idempotency_key), f"op-{len(self.keys)}")
            return IntentReply(created=not known, operation=self._summary(op_id, "pending"))

        @broker.subscriber(SUBJECTS.rpc_operation_wait_for("acme"))
        async def waits(wait: OperationWait) -> OperationReply:
            seen = sum(1 for w in self.waits if w.operation_id == wait.operation_id)
            self.waits.append(wait)
            state = self.states[min(seen, len(self.states) - 1)]
            return OperationReply(operation=self._summary(wait.operation_id, state))

    @staticmethod
    def _summary(op_id: str, state: str) -> OperationSummary:
        return OperationSummary(id=op_id, state=state, epoch=1, operation_key="k-" + op_id,
                                tool="create_ticket")


def _router(**options: Any) -> LedgerRouter:
    return LedgerRouter("acme", subjects=SUBJECTS, retry_delay_s=0.01, approval_poll_s=0.01,
                        **options)


async def test_an_intent_is_submitted_and_its_operation_received_once_at_rest() -> None:
    broker = NatsBroker()
    ledger = _router()
    fake = FakeLedger(broker, "in_flight", "ambiguous", "awaiting_approval", "succeeded")
    got: list[OperationReply] = []

    @ledger.on_settled
    async def settled(reply: OperationReply) -> None:
        got.append(reply)

    broker.include_router(ledger)
    async with TestNatsBroker(broker):
        reply = await ledger.submit(SubmitIntent(tool="create_ticket", arguments={"t": 1},
                                                 idempotency_key="order-1"))
        assert reply.created is True and fake.intents[0].idempotency_key == "order-1"
        await wait_until(lambda: got, 10, what="the settled operation")
        # Waits that ended in flight, ambiguous or awaiting approval were asked again.
        assert [w.operation_id for w in fake.waits] == [reply.operation.id] * 4
        assert [r.operation.state for r in got] == ["succeeded"]
        assert ledger.settled_subject.startswith("_INBOX_agent-acme.")


async def test_a_handler_that_raised_gets_the_operation_again() -> None:
    broker = NatsBroker()
    ledger = _router(redeliveries=3)
    FakeLedger(broker, "succeeded")
    calls: list[str] = []

    @ledger.on_settled
    async def flaky(reply: OperationReply) -> None:
        calls.append(reply.operation.state)
        if len(calls) == 1:
            raise RuntimeError("the handler's own database was down")

    broker.include_router(ledger)
    async with TestNatsBroker(broker):
        await ledger.submit(SubmitIntent(tool="create_ticket", idempotency_key="order-2"))
        await wait_until(lambda: len(calls) >= 2, 10, what="the redelivery")
        assert calls == ["succeeded", "succeeded"]


async def test_refusals_and_bad_intents_are_clear_errors_and_send_nothing_twice() -> None:
    broker = NatsBroker()
    ledger = _router()
    fake = FakeLedger(broker, "succeeded")
    broker.include_router(ledger)
    async with TestNatsBroker(broker):
        with pytest.raises(ValueError, match="idempotency_key is required"):
            await ledger.submit(SubmitIntent(tool="create_ticket"))
        with pytest.raises(ValueError, match="tenant"):
            await ledger.submit(SubmitIntent(tool="create_ticket", tenant="globex",
                                             idempotency_key="k"))
        assert fake.intents == []
        with pytest.raises(LedgerRefused, match="invalid_request"):
            await ledger.submit(SubmitIntent(tool="nope", idempotency_key="k"))
        assert fake.waits == []  # nothing to watch
        first = await ledger.submit(SubmitIntent(tool="create_ticket", idempotency_key="k2"),
                                    watch=False)
        again = await ledger.submit(SubmitIntent(tool="create_ticket", idempotency_key="k2"),
                                    watch=False)
        assert again.operation.id == first.operation.id and again.created is False
