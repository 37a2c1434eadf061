"""What the dispatcher's worker needs from the world, as protocols; the NATS and HTTP (aiohttp)
implementations live here too, and `effectledger_bus.testing` has fakes of each.

- `LedgerClient`: the claim and the outcome request-replies (`NatsLedgerClient`);
- `Publisher`: JetStream publish with publish-ack (`effectledger_bus.publish`);
- `ProviderCaller`: one provider attempt classified into an outcome (`HttpProviderCaller`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from nats.aio.client import Client as NatsClient

from effectledger_bus.publish import Publisher
from effectledger_bus.rpc import request
from effectledger_core.catalog import Tool
from effectledger_core.ids import Clock, utcnow
from effectledger_core.messages import (
    ClaimAnswer,
    ClaimAttempt,
    ClaimReply,
    DispatchAttempt,
    Outcome,
    OutcomeAnswer,
    OutcomeRecorded,
    encode,
)
from effectledger_core.subjects import Subjects
from effectledger_providers.calls import call_provider
from effectledger_providers.session import ProviderClient

__all__ = ["HttpProviderCaller", "LedgerClient", "NatsLedgerClient", "ProviderCaller",
           "Publisher"]


class LedgerClient(Protocol):
    async def claim(self, request: ClaimAttempt) -> ClaimAnswer:
        """The ledger's answer to a claim: a `ClaimReply`, or an `ErrorReply` if it refused.

        Raises `effectledger_bus.rpc.NoReply` when nobody answered, PoisonMessage when the
        answer is malformed. Asking again with the same attempt id is safe: the ledger grants
        the same attempt again.
        """
        ...

    async def report(self, outcome: Outcome, *, timeout_s: float) -> OutcomeAnswer:
        """The ledger's answer to an outcome sent by request: `OutcomeRecorded` once its inbox
        committed it, or an `ErrorReply` (`error.retryable` says whether asking again may help).

        Raises `NoReply` when nobody answered within `timeout_s`, PoisonMessage when the
        answer is malformed. Without an `OutcomeRecorded` nothing is known: the outcome may or
        may not be committed, and its JetStream copy (same message id) settles it.
        """
        ...


class ProviderCaller(Protocol):
    async def __call__(self, tool: Tool, cmd: DispatchAttempt, *, attempt_id: str,
                       dispatcher_id: str, on_sent: Callable[[], None],
                       before_write: Callable[[], None]) -> Outcome:
        """Exactly one attempt; `on_sent` runs right before the request is handed to the
        HTTP client, `before_write` immediately before its first byte is written (perhaps
        more than once: it must be a pure check; raising
        `effectledger_providers.calls.SendRefused` there means: send nothing, report it)."""
        ...


class NatsLedgerClient:
    def __init__(self, nc: NatsClient, subjects: Subjects, *, dispatcher_id: str,
                 timeout_s: float = 5.0) -> None:
        self.nc = nc
        # The dispatcher's own claim subject: NATS lets it publish there only, so the ledger
        # records the claim's holder from the subject (see effectledger_bus.permissions).
        self.subject = subjects.rpc_claim_by(dispatcher_id)
        self.outcome_subject = subjects.rpc_outcome_by(dispatcher_id)  # the same, for outcomes
        self.timeout_s = timeout_s

    async def claim(self, claim: ClaimAttempt) -> ClaimAnswer:
        return await request(self.nc, self.subject, encode(claim), ClaimReply,
                             timeout_s=self.timeout_s)

    async def report(self, outcome: Outcome, *, timeout_s: float) -> OutcomeAnswer:
        return await request(self.nc, self.outcome_subject, encode(outcome), OutcomeRecorded,
                             timeout_s=timeout_s)


class HttpProviderCaller:
    """Provider calls over several small connection pools, taken in turn (see
    `effectledger_providers.calls.make_clients` for why several)."""

    def __init__(self, clients: Sequence[ProviderClient], *, env: Mapping[str, str],
                 clock: Clock = utcnow) -> None:
        if not clients:
            raise ValueError("at least one HTTP client")
        self.clients = list(clients)
        self.env = env
        self.clock = clock
        self._next = 0

    def client(self) -> ProviderClient:
        self._next = (self._next + 1) % len(self.clients)
        return self.clients[self._next]

    async def __call__(self, tool: Tool, cmd: DispatchAttempt, *, attempt_id: str,
                       dispatcher_id: str, on_sent: Callable[[], None],
                       before_write: Callable[[], None] | None = None) -> Outcome:
        # before_write is optional here for callers outside the dispatcher (the benchmark's
        # direct peer); the dispatcher always passes its send-deadline check.
        return await call_provider(self.client(), tool, cmd, attempt_id=attempt_id,
                                   dispatcher_id=dispatcher_id, env=self.env, clock=self.clock,
                                   on_sent=on_sent, before_write=before_write)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
