"""Subjects and stream names (versioned; documented in docs/asyncapi.yaml).

Request-reply subjects live outside every stream's subject space: a stream that captured a
request would answer it with a publish-ack instead of the service's reply.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Subjects:
    prefix: str = "effects"
    stream_prefix: str = "EFFECTS"

    # JetStream subjects
    def dispatch(self, tool: str) -> str:
        return f"{self.prefix}.dispatch.v1.{tool}"

    @property
    def dispatch_all(self) -> str:
        return f"{self.prefix}.dispatch.v1.>"

    # Events are named by who consumes them, so each consumer filters on one subtree.
    def outcome(self, kind: str) -> str:
        return f"{self.prefix}.ledger.v1.outcome.{kind}"

    @property
    def verdict(self) -> str:
        return f"{self.prefix}.ledger.v1.verdict"

    @property
    def webhook(self) -> str:
        return f"{self.prefix}.ledger.v1.webhook"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}.ledger.v1.deadletter"

    @property
    def ledger_all(self) -> str:
        return f"{self.prefix}.ledger.v1.>"

    @property
    def ambiguous(self) -> str:
        return f"{self.prefix}.reconcile.v1.ambiguous"

    @property
    def reconcile_all(self) -> str:
        return f"{self.prefix}.reconcile.v1.>"

    # request-reply (core NATS)
    @property
    def rpc_intents(self) -> str:
        return f"{self.prefix}.rpc.v1.intents"

    @property
    def rpc_claim(self) -> str:
        return f"{self.prefix}.rpc.v1.claim"

    @property
    def rpc_operation(self) -> str:
        """Read-only: `{"operation_id": ...}` → `{"ok": true, "operation": {state, epoch, ...}}`."""
        return f"{self.prefix}.rpc.v1.operation"

    @property
    def rpc_operation_wait(self) -> str:
        """`{"operation_id", "wait_s"}` → the same reply once the operation is settled (at rest
        or awaiting approval) or the wait (capped by the ledger) is over."""
        return f"{self.prefix}.rpc.v1.operation.wait"

    # streams
    @property
    def dispatch_stream(self) -> str:
        return f"{self.stream_prefix}_DISPATCH"

    @property
    def events_stream(self) -> str:
        return f"{self.stream_prefix}_EVENTS"

    @property
    def events_subjects(self) -> list[str]:
        return [self.ledger_all, self.reconcile_all]
