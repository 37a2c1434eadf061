"""Placeholder composition root: the reconciler consumes nothing until it is built.

It deliberately does not subscribe: acknowledging ambiguity notices without resolving them
would lose them. Running it only proves the process wiring of `effectledger up`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

from effectledger_core.config import Settings


async def serve(settings: Settings, *, started: asyncio.Event | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    print("reconciler ready: placeholder (ambiguous outcomes stay queued until it is built)",
          flush=True)
    if started is not None:
        started.set()
    await stop.wait()
