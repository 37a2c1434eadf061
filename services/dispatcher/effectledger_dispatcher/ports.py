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
from effectledger_providers.calls import PER_CLIENT, call_provider
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
    """Provider calls over several small connection pools (see
    `effectledger_providers.calls.make_clients` for why several).

    A call takes the first pool with fewer than `per_client` calls in flight, so calls spread
    over more pools only as more run at once. Taken in turn instead, an agent's calls, one at a
    time, each found a pool whose connection had been idle for as many calls as there are pools
    (8 by default), past the 2 s keep-alive (`session.KEEPALIVE_S`) whenever they came more
    than a quarter of a second apart: every call then paid a new connection (a TLS handshake,
    to a real provider). First with room, calls up to 2 s apart reuse the last one.
    """

    def __init__(self, clients: Sequence[ProviderClient], *, env: Mapping[str, str],
                 clock: Clock = utcnow, per_client: int = PER_CLIENT) -> None:
        if not clients:
            raise ValueError("at least one HTTP client")
        if per_client < 1:
            raise ValueError("per_client must be at least 1")
        self.clients = list(clients)
        self.env = env
        self.clock = clock
        self.per_client = per_client
        self.in_flight = [0] * len(self.clients)

    def pick(self) -> int:
        """The first pool with room; when none has, the least busy (each pool bounds itself)."""
        for index, busy in enumerate(self.in_flight):
            if busy < self.per_client:
                return index
        return self.in_flight.index(min(self.in_flight))

    async def __call__(self, tool: Tool, cmd: DispatchAttempt, *, attempt_id: str,
                       dispatcher_id: str, on_sent: Callable[[], None],
                       before_write: Callable[[], None] | None = None) -> Outcome:
        # before_write is optional here for callers outside the dispatcher (the benchmark's
        # direct peer); the dispatcher always passes its send-deadline check.
        index = self.pick()
        self.in_flight[index] += 1
        try:
            return await call_provider(self.clients[index], tool, cmd, attempt_id=attempt_id,
                                       dispatcher_id=dispatcher_id, env=self.env,
                                       clock=self.clock, on_sent=on_sent,
                                       before_write=before_write)
        finally:
            self.in_flight[index] -= 1

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()
