"""The reconciler's read of the ledger: the `rpc_operation` request-reply subject.

`{"operation_id": "..."}` → `{"ok": true, "operation": {"id", "state", "epoch", "operation_key",
"tool", "provider_ref"}}` or `{"ok": false, "error": {"code", "message"}}`. The reconciler never
writes the ledger; what it reads here only tells it whether a command is still worth working on
(the ledger guards every verdict by epoch and state anyway).
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Protocol

from nats.aio.client import Client as NatsClient
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from effectledger_core.errors import EffectLedgerError
from effectledger_core.subjects import Subjects

from .strategy import OperationView

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


def parse_operation_reply(raw: bytes) -> OperationView | None:
    """Read an `rpc_operation` reply; raises LedgerUnavailable if it is not a usable answer."""
    try:
        body: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise LedgerUnavailable("the ledger's reply is not JSON") from exc
    if not isinstance(body, dict):
        raise LedgerUnavailable("the ledger's reply is not a JSON object")
    if body.get("ok") is True:
        op = body.get("operation")
        if not isinstance(op, dict):
            raise LedgerUnavailable("the ledger's reply has no operation")
        state, epoch, op_id = op.get("state"), op.get("epoch"), op.get("id")
        if not isinstance(state, str) or not isinstance(op_id, str) \
                or not isinstance(epoch, int) or isinstance(epoch, bool):
            raise LedgerUnavailable("the ledger's operation lacks id, state or epoch")
        return OperationView(id=op_id, state=state, epoch=epoch,
                             operation_key=_opt_str(op.get("operation_key")),
                             tool=_opt_str(op.get("tool")),
                             provider_ref=_opt_str(op.get("provider_ref")))
    error = body.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    if code == "not_found":
        return None
    raise LedgerUnavailable(f"the ledger refused the operation read: {code or 'no error code'}",
                            reply=str(error)[:300])


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class NatsLedgerClient:
    def __init__(self, nc: NatsClient, subjects: Subjects, *, timeout_s: float = 5.0) -> None:
        self.nc = nc
        self.subjects = subjects
        self.timeout_s = timeout_s

    async def operation(self, operation_id: str) -> OperationView | None:
        payload = json.dumps({"operation_id": operation_id}).encode()
        try:
            msg = await self.nc.request(self.subjects.rpc_operation, payload,
                                        timeout=self.timeout_s)
        except (TimeoutError, NatsTimeout, NoRespondersError, ConnectionClosedError) as exc:
            raise LedgerUnavailable(f"operation read: {type(exc).__name__}") from exc
        return parse_operation_reply(msg.data)
