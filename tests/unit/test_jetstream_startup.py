"""Start-up JetStream calls wait out a broker that cannot answer yet, and only that."""

from __future__ import annotations

import nats.errors
import pytest
from nats.js.errors import BadRequestError

from effectledger_bus.streams import at_startup


async def test_a_broker_that_cannot_answer_yet_is_waited_for() -> None:
    failures = [nats.errors.TimeoutError(), nats.errors.NoRespondersError()]
    calls = 0

    async def call() -> str:
        nonlocal calls
        calls += 1
        if failures:
            raise failures.pop(0)
        return "ready"

    assert await at_startup(call) == "ready"
    assert calls == 3


async def test_a_refused_configuration_fails_at_once() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise BadRequestError(description="invalid stream config")

    with pytest.raises(BadRequestError):
        await at_startup(call)
    assert calls == 1
