"""Publishing to JetStream with a message id, returning only after the publish-ack.

Every service needs the same guarantee: it settles its input (acks a command, answers a
webhook 2xx) only after JetStream has stored the output. Ids come from `effectledger_bus.catalogue`,
so a republish after a lost ack is dropped by the stream's duplicate window. Tests use
`effectledger_bus.testing.FakePublisher`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from nats.js import JetStreamContext
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    stop_any,
    wait_exponential,
)
from tenacity.stop import stop_base

from effectledger_core.errors import BrokerUnavailable
from effectledger_obs import tracing


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
        headers = {"Nats-Msg-Id": msg_id}
        tracing.inject(headers)  # the consumer's span joins the publisher's trace (when on)
        try:
            ack = await self.js.publish(subject, payload, headers=headers,
                                        timeout=self.timeout_s)
        except Exception as exc:  # timeouts, no stream, closed connection: all "not stored"
            raise BrokerUnavailable(f"publish to {subject}: {type(exc).__name__}: {exc}"[:500]
                                    ) from exc
        return bool(ack.duplicate)


async def publish_with_retries(
    publisher: Publisher, subject: str, payload: bytes, *, msg_id: str,
    attempts: int | None = None, within_s: float | None = None, first_wait_s: float = 0.2,
    max_wait_s: float = 3.0, before_retry: Callable[[], Awaitable[None]] | None = None,
) -> bool:
    """Publish, retrying a BrokerUnavailable with doubling pauses until `attempts` or `within_s`.

    Republishing under the same message id is safe: JetStream keeps one copy. `before_retry`
    runs before each retry (a heartbeat on the delivery being worked on). The last
    BrokerUnavailable is raised.
    """
    if attempts is None and within_s is None:
        raise ValueError("give attempts, within_s or both")
    stops: list[stop_base] = []
    if attempts is not None:
        stops.append(stop_after_attempt(attempts))
    if within_s is not None:
        stops.append(stop_after_delay(within_s))
    async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(BrokerUnavailable), stop=stop_any(*stops),
            wait=wait_exponential(multiplier=first_wait_s, max=max_wait_s), reraise=True):
        with attempt:
            if attempt.retry_state.attempt_number > 1 and before_retry is not None:
                await before_retry()
            return await publisher.publish(subject, payload, msg_id=msg_id)
    raise AssertionError("unreachable: tenacity either returns or re-raises")
