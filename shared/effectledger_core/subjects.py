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

    # Each dispatcher publishes its outcomes under its own id, and NATS permissions let it
    # publish nowhere else: the ledger reads the sender from the subject (`outcome_sender`).
    def outcome_by(self, dispatcher_id: str, kind: str) -> str:
        return f"{self.prefix}.ledger.v1.outcome.{dispatcher_id}.{kind}"

    def outcomes_of(self, dispatcher_id: str) -> str:
        return f"{self.prefix}.ledger.v1.outcome.{dispatcher_id}.>"

    def outcome_sender(self, subject: str) -> str | None:
        """The dispatcher id an outcome subject names; None for the unbound `outcome(kind)`."""
        head = f"{self.prefix}.ledger.v1.outcome."
        if not subject.startswith(head):
            return None
        rest = subject[len(head):]
        sender, _, _kind = rest.rpartition(".")
        return sender or None

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
    def rpc_all(self) -> str:
        return f"{self.prefix}.rpc.v1.>"

    @property
    def rpc_intents(self) -> str:
        """Intents naming their tenant in the payload: for trusted tools (operator role)."""
        return f"{self.prefix}.rpc.v1.intents"

    # Tenant-bound request subjects, all under `rpc.v1.tenant.<tenant>.`: NATS permissions let
    # an agent publish only under its own tenant's, and the ledger takes the tenant from the
    # subject, never from the payload. (A subtree of their own, so that no tenant name can
    # collide with another request subject such as `rpc.v1.operation.wait`.)
    def tenant_requests(self, tenant: str) -> str:
        return f"{self.prefix}.rpc.v1.tenant.{tenant}.>"

    def rpc_intents_for(self, tenant: str) -> str:
        return f"{self.prefix}.rpc.v1.tenant.{tenant}.intents"

    def rpc_operation_for(self, tenant: str) -> str:
        return f"{self.prefix}.rpc.v1.tenant.{tenant}.operation"

    def rpc_operation_wait_for(self, tenant: str) -> str:
        """An agent's wait on its own tenant's operation (one token, like its neighbours)."""
        return f"{self.prefix}.rpc.v1.tenant.{tenant}.wait"

    def tenant_of(self, subject: str) -> str | None:
        """The tenant a tenant-bound request subject names, or None."""
        head = f"{self.prefix}.rpc.v1.tenant."
        if not subject.startswith(head):
            return None
        tenant, dot, _rest = subject[len(head):].partition(".")
        return tenant if tenant and dot else None

    def rpc_claim_by(self, dispatcher_id: str) -> str:
        """A dispatcher's own claim subject: the claim's holder is the subject's sender."""
        return f"{self.prefix}.rpc.v1.claim.{dispatcher_id}"

    @property
    def rpc_outcome(self) -> str:
        """The base of the dispatchers' outcome request subjects (nobody publishes on it)."""
        return f"{self.prefix}.rpc.v1.outcome"

    def rpc_outcome_by(self, dispatcher_id: str) -> str:
        """A dispatcher's own outcome request subject: the ledger commits the outcome to its
        inbox and answers, the shorter path before the JetStream copy (the sender is the
        subject's dispatcher id, exactly like `rpc_claim_by`)."""
        return f"{self.prefix}.rpc.v1.outcome.{dispatcher_id}"

    def rpc_tail(self, subject: str, base: str) -> str | None:
        """What follows `base.` in `subject` (the tenant or dispatcher id), or None."""
        if not subject.startswith(base + "."):
            return None
        return subject[len(base) + 1:] or None

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
