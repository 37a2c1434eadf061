"""The reconciler's read of the ledger: the `rpc_operation` request-reply subject.

`OperationQuery` → `OperationReply` or `ErrorReply` (models in `effectledger_core.messages`).
The reconciler never writes the ledger; what it reads here only tells it whether a command is
still worth working on (the ledger guards every verdict by epoch and state anyway).
"""

from __future__ import annotations

import logging
from typing import ClassVar, Protocol

from nats.aio.client import Client as NatsClient

from effectledger_bus.rpc import NoReply, request
from effectledger_core.errors import EffectLedgerError, PayloadTooLarge, PoisonMessage
from effectledger_core.messages import (
    ErrorReply,
    OperationAnswer,
    OperationQuery,
    OperationReply,
    encode,
    parse_answer,
)
from effectledger_core.states import State
from effectledger_core.subjects import Subjects

from .decisions import OperationView

log = logging.getLogger(__name__)


class LedgerUnavailable(EffectLedgerError):
    """No usable answer from the ledger (timeout, no responders, an error or malformed reply)."""

    code: ClassVar[str] = "ledger_unavailable"
    http_status: ClassVar[int] = 503
    retryable: ClassVar[bool] = True


class LedgerClient(Protocol):
    async def operation(self, operation_id: str) -> OperationView | None:
        """The operation's current view; None if the ledger does not know it.

        Raises LedgerUnavailable when the ledger cannot be asked or does not answer usefully.
        """
        ...


def operation_view(answer: OperationAnswer) -> OperationView | None:
    """What an `rpc_operation` answer says; raises LedgerUnavailable for an error other than
    "not found"."""
    if isinstance(answer, ErrorReply):
        if answer.error.code == "not_found":
            return None
        raise LedgerUnavailable(f"the ledger refused the operation read: {answer.error.code}",
                                reply=answer.error.message[:300])
    op = answer.operation
    try:
        state = State(op.state)
    except ValueError:
        # A ledger newer than this reconciler: nothing is decided on a state it cannot read.
        raise LedgerUnavailable(f"the ledger answered an unknown state {op.state[:100]!r}"
                                ) from None
    return OperationView(id=op.id, state=state, epoch=op.epoch,
                         operation_key=op.operation_key, tool=op.tool,
                         provider_ref=op.provider_ref, arguments_digest=op.arguments_digest)


def parse_operation_reply(raw: bytes) -> OperationView | None:
    """Read an `rpc_operation` reply; raises LedgerUnavailable if it is not a usable answer."""
    try:
        return operation_view(parse_answer(OperationReply, raw))
    except (PoisonMessage, PayloadTooLarge) as exc:
        raise LedgerUnavailable(f"the ledger's reply is malformed: {exc.message}"[:500]) from exc


class NatsLedgerClient:
    def __init__(self, nc: NatsClient, subjects: Subjects, *, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.subjects = subjects
        self.timeout_s = timeout_s

    async def operation(self, operation_id: str) -> OperationView | None:
        try:
            answer = await request(self.nc, self.subjects.rpc_operation,
                                   encode(OperationQuery(operation_id=operation_id)),
                                   OperationReply, timeout_s=self.timeout_s)
        except NoReply as exc:
            raise LedgerUnavailable(f"operation read: {exc.message}") from exc
        except (PoisonMessage, PayloadTooLarge) as exc:
            raise LedgerUnavailable(f"the ledger's reply is malformed: {exc.message}"[:500]
                                    ) from exc
        return operation_view(answer)
