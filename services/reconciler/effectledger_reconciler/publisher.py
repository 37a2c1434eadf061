"""Publishing to JetStream with a message id, returning only after the publish-ack.

Both halves of the reconciler (verdicts, webhook evidence) need the same guarantee: a caller
acks its input (a command, an HTTP 2xx) only after JetStream has stored the output. Tests use a
fake with the same protocol.
"""

from __future__ import annotations

from typing import Protocol

from nats.js import JetStreamContext

from effectledger_core.errors import BrokerUnavailable


class Publisher(Protocol):
    async def publish(self, subject: str, payload: bytes, *, msg_id: str) -> bool:
        """Store `payload` on `subject` with `Nats-Msg-Id: msg_id`; True if it was a duplicate.

        Raises BrokerUnavailable if JetStream did not acknowledge it.
        """
        ...


class JetStreamPublisher:
    def __init__(self, js: JetStreamContext, *, timeout_s: float = 5.0) -> None:
        self.js = js
        self.timeout_s = timeout_s

    async def publish(self, subject: str, payload: bytes, *, msg_id: str) -> bool:
        try:
            ack = await self.js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id},
                                        timeout=self.timeout_s)
        except Exception as exc:  # timeouts, no stream, closed connection: all "not stored"
            raise BrokerUnavailable(f"publish to {subject}: {type(exc).__name__}: {exc}"[:500]
                                    ) from exc
        return bool(ack.duplicate)
