"""Every `Nats-Msg-Id` the services publish under, in one place.

JetStream drops a message whose id it has seen within the stream's duplicate window, and the
ledger's inbox deduplicates by (consumer, message id) for longer. So an id must be the same for
every copy of one fact, and differ between facts:

- dispatch command: `<outbox id>`, or `<outbox id>.r<n>` for the n-th sweeper republish; a
  copy is a relay retry of the same generation;
- outcome: `<outcome type>:<attempt id>`; a copy is a dispatcher's republish;
- verdict: `verdict:<operation>:<epoch>:<verdict>`; a copy is another replica's equal finding;
- verified webhook: `webhook:<provider>:<webhook id>`; a copy is the provider's redelivery;
- dead letter: `deadletter:<consumer>:<message id or subject>:<deliveries>`; a copy is a
  retried dead-lettering.

A sweeper republish of a dispatch command gets a new `.r<n>`: it must get through the duplicate
window, because the first copy was lost. Pure functions: no I/O.
"""

from __future__ import annotations

from effectledger_core.messages import DeadLetter, Outcome, VerdictReached


def dispatch(outbox_id: str, publish_count: int) -> str:
    """A dispatch command's id: the outbox row's, plus `.r<n>` for the n-th sweeper republish."""
    return outbox_id if publish_count == 0 else f"{outbox_id}.r{publish_count}"


def outcome(o: Outcome) -> str:
    return f"{o.type}:{o.attempt_id}"


def verdict(v: VerdictReached) -> str:
    # Not the reconciler's id: two replicas reaching the same verdict state one fact.
    return f"verdict:{v.operation_id}:{v.epoch}:{v.verdict}"


def webhook(provider: str, webhook_id: str) -> str:
    return f"webhook:{provider}:{webhook_id}"


def dead_letter(letter: DeadLetter) -> str:
    return (f"deadletter:{letter.consumer}:{letter.message_id or letter.subject}:"
            f"{letter.deliveries}")
