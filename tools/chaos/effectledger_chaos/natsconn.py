"""A nats-py connection for the harness's own reads and faults, quiet about broker outages.

A module of its own below both the stack (which waits for JetStream with it) and the readers
in `collect` (which read the final state through the stack): the seam that keeps the two from
importing each other.
"""

from __future__ import annotations

from typing import Any

import nats


async def _quiet(*_: Any) -> None:
    return None  # broker outages are expected in a chaos run; nats-py would print tracebacks


async def connect_quiet(url: str | list[str], **options: Any) -> Any:
    """A nats-py connection that does not print tracebacks for expected broker outages."""
    return await nats.connect(url, error_cb=_quiet, disconnected_cb=_quiet,
                              reconnected_cb=_quiet, closed_cb=_quiet, **options)
