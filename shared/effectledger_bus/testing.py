"""Fakes of the messaging edge for unit tests: they behave like the real thing, in memory.

- `FakeDelivery`: a JetStream delivery that records how it was settled;
- `FakePublisher`: JetStream's duplicate detection by message id, with outages on demand;
- `FakeJetStream`: the nats-py `JetStreamContext.publish` surface, for code that takes one;
- `FakeLedger`: the ledger's request-reply side — the claim rule (first claimer of an epoch
  wins, the same attempt id is granted again), outcomes by request (committed once per message
  id, answered after) and operation reads — with outages on demand.

Fakes, not mocks: a test states what happened (`d.acked`, `publisher.on(subject)`), not which
calls were made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Generic, TypeVar

from effectledger_core.errors import BrokerUnavailable
from effectledger_core.messages import (
    ClaimAnswer,
    ClaimAttempt,
    ClaimReply,
    ClaimStatus,
    ErrorReply,
    Message,
    Outcome,
    OutcomeAnswer,
    OutcomeRecorded,
    parse,
)

from . import catalogue
from .rpc import NoReply

V = TypeVar("V")
M = TypeVar("M", bound=Message)


@dataclass
class FakeDelivery:
    data: bytes
    deliveries: int = 1
    subject: str = "t.test.v1"
    headers: Mapping[str, str] = field(default_factory=lambda: {"Nats-Msg-Id": "outbox-1"})
    acked: bool = False
    termed: bool = False
    naks: list[float] = field(default_factory=list)
    beats: int = 0
    beaten: asyncio.Event = field(default_factory=asyncio.Event)  # set by every in_progress

    async def ack(self) -> None:
        self.acked = True

    async def nak(self, delay: float) -> None:
        self.naks.append(delay)

    async def term(self) -> None:
        self.termed = True

    async def in_progress(self) -> None:
        self.beats += 1
        self.beaten.set()

    @property
    def settled(self) -> bool:
        """Acked, nak'd or terminated: JetStream will not wait for ack_wait to redeliver it."""
        return self.acked or self.termed or bool(self.naks)


class FakePublisher:
    """JetStream-like: stores (subject, payload, msg_id); a repeated msg id is a duplicate."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes, str]] = []
        self.failures = 0  # the next `failures` publishes fail
        self.down = False  # every publish fails while set
        self.publishes = 0

    async def publish(self, subject: str, payload: bytes, *, msg_id: str) -> bool:
        self.publishes += 1
        if self.down or self.failures:
            self.failures = max(0, self.failures - 1)
            raise BrokerUnavailable("publish: TimeoutError")
        duplicate = any(m[2] == msg_id for m in self.messages)
        if not duplicate:
            self.messages.append((subject, payload, msg_id))
        return duplicate

    def on(self, subject: str) -> list[tuple[bytes, str]]:
        """(payload, msg_id) of what was stored on `subject`, in order."""
        return [(p, i) for s, p, i in self.messages if s == subject]

    def decoded(self, model: type[M]) -> list[M]:
        """Every stored payload parsed as `model`, in order."""
        return [parse(model, p) for _, p, _ in self.messages]


@dataclass(frozen=True)
class FakeAck:
    seq: int
    duplicate: bool = False


class FakeJetStream:
    """Records publishes; `fail` makes every publish raise, as a broker outage would."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.published: list[tuple[str, dict[str, str]]] = []
        self.payloads: list[bytes] = []
        self.arrived = asyncio.Event()  # set by every publish (failed ones included)

    async def publish(self, subject: str, payload: bytes, timeout: float,  # noqa: ASYNC109
                      headers: dict[str, str]) -> FakeAck:
        self.arrived.set()
        if self.fail:
            raise TimeoutError("no publish ack")
        self.published.append((subject, headers))
        self.payloads.append(payload)
        return FakeAck(len(self.published))


@dataclass
class _Claim:
    attempt_id: str
    claimed_at: datetime


class FakeLedger(Generic[V]):
    """The ledger as the dispatcher and the reconciler ask it (request-reply only).

    Claims follow the ledger's rule: the first attempt id to claim an epoch holds it and is
    granted again when it asks again; any other is `already_claimed`, with the claim's age from
    `now` and whether an outcome was recorded. `unanswered` claims get no reply at all (the
    requester sees NoReply), as when the ledger is down; `down` fails every call with the given
    error. `operations` answer reads.

    Outcomes by request are committed under their message id, once (`reported`, in order;
    a second copy answers `duplicate`), and mark their epoch's claim as having an outcome.
    `reports_unanswered`: the next ones get no reply; with `reports_lost` they are committed
    first (the answer lost on its way back). `report_error` answers every one with that
    ErrorReply instead, committing nothing.
    """

    def __init__(self, operations: dict[str, V] | None = None, *,
                 now: datetime | None = None) -> None:
        self.operations: dict[str, V] = operations or {}
        self.now = now or datetime.now().astimezone()
        self.claims: dict[tuple[str, int], _Claim] = {}
        self.outcomes: set[tuple[str, int]] = set()  # (operation, epoch) with an outcome
        self.current_epoch: dict[str, int] = {}  # operation → epoch; lower epochs are stale
        self.unanswered = 0  # the next `unanswered` claims get no reply
        self.down: Exception | None = None
        self.requests: list[ClaimAttempt] = []
        self.reads = 0
        self.reported: dict[str, Outcome] = {}  # committed outcomes by message id
        self.reports_unanswered = 0
        self.reports_lost = False
        self.report_error: ErrorReply | None = None
        self.report_timeouts: list[float] = []  # each report's timeout, in order

    def hold(self, operation_id: str, epoch: int, attempt_id: str, *, age_s: float = 0.0,
             outcome_recorded: bool = False) -> None:
        """Record a claim made `age_s` ago by another dispatcher."""
        self.claims[(operation_id, epoch)] = _Claim(attempt_id,
                                                    self.now - timedelta(seconds=age_s))
        if outcome_recorded:
            self.outcomes.add((operation_id, epoch))

    async def claim(self, request: ClaimAttempt) -> ClaimAnswer:
        self.requests.append(request)
        if self.down is not None:
            raise self.down
        if self.unanswered:
            self.unanswered -= 1
            raise NoReply("claim: TimeoutError")
        op, epoch = key = (request.operation_id, request.epoch)
        current = self.current_epoch.get(op, epoch)
        if epoch != current:
            return ClaimReply(status=ClaimStatus.STALE_EPOCH, operation_id=op, epoch=epoch,
                              current_epoch=current)
        held = self.claims.setdefault(key, _Claim(request.attempt_id, self.now))
        if held.attempt_id == request.attempt_id:
            return ClaimReply(status=ClaimStatus.GRANTED, operation_id=op, epoch=epoch,
                              attempt_id=held.attempt_id)
        return ClaimReply(status=ClaimStatus.ALREADY_CLAIMED, operation_id=op, epoch=epoch,
                          attempt_id=held.attempt_id, outcome_recorded=key in self.outcomes,
                          claim_age_s=(self.now - held.claimed_at).total_seconds())

    async def report(self, outcome: Outcome, *, timeout_s: float) -> OutcomeAnswer:
        self.report_timeouts.append(timeout_s)
        if self.down is not None:
            raise self.down
        if self.report_error is not None:
            return self.report_error
        if self.reports_unanswered and not self.reports_lost:
            self.reports_unanswered -= 1
            raise NoReply("outcome: TimeoutError")
        msg_id = catalogue.message_id(outcome)
        status = "duplicate" if msg_id in self.reported else "applied"
        self.reported.setdefault(msg_id, outcome)
        self.outcomes.add((outcome.operation_id, outcome.epoch))
        if self.reports_unanswered:
            self.reports_unanswered -= 1
            raise NoReply("outcome: TimeoutError")
        return OutcomeRecorded(status=status, operation_id=outcome.operation_id,
                               attempt_id=outcome.attempt_id, message_id=msg_id)

    async def operation(self, operation_id: str) -> V | None:
        self.reads += 1
        if self.down is not None:
            raise self.down
        return self.operations.get(operation_id)
