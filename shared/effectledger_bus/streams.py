"""Stream definitions (also described in infra/nats/streams.json and docs/asyncapi.yaml).

Streams are created or updated idempotently at service start. File storage by default: the
dispatch stream is the transport of committed intents, so it should survive a broker restart
(the ledger's sweeper repairs what is lost anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

from effectledger_core.config import Settings

log = logging.getLogger(__name__)
T = TypeVar("T")


def _transient(exc: BaseException) -> bool:
    """Worth waiting out at start-up: the server is unreachable, restarting or electing. A
    refused configuration (400) is our mistake and must fail the start at once."""
    if isinstance(exc, BadRequestError):
        return False
    return isinstance(exc, nats.errors.Error | TimeoutError | OSError)


def _log_wait(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning("JetStream not ready at start-up (%s: %s); trying again in %.1fs",
                type(exc).__name__, exc, wait)


async def at_startup(call: Callable[[], Awaitable[T]]) -> T:
    """Run a start-up JetStream call, waiting (without bound, logging each try) while the server
    cannot answer: a service started during a broker restart must wait for it, not exit and
    crash-loop. Readiness probes report the service not ready meanwhile."""
    async for attempt in AsyncRetrying(retry=retry_if_exception(_transient),
                                       wait=wait_exponential(multiplier=0.2, max=5.0),
                                       before_sleep=_log_wait, reraise=True):
        with attempt:
            return await call()
    raise AssertionError("unreachable")  # pragma: no cover


def stream_configs(settings: Settings) -> list[StreamConfig]:
    subjects = settings.subjects
    storage = StorageType.FILE if settings.stream_storage == "file" else StorageType.MEMORY
    common = dict(storage=storage, num_replicas=settings.stream_replicas,
                  max_age=settings.stream_max_age_s, duplicate_window=settings.duplicate_window_s,
                  discard=DiscardPolicy.OLD, max_msg_size=512 * 1024)
    return [
        # Work queue: a dispatch command is removed once a dispatcher acks it.
        StreamConfig(name=subjects.dispatch_stream, subjects=[subjects.dispatch_all],
                     retention=RetentionPolicy.WORK_QUEUE,
                     description="effectledger dispatch commands (from the ledger outbox)",
                     **common),  # type: ignore[arg-type]
        # Also a work queue: the ledger's and the reconciler's consumers filter on disjoint
        # subtrees, and acknowledged events leave no backlog behind.
        StreamConfig(name=subjects.events_stream, subjects=subjects.events_subjects,
                     retention=RetentionPolicy.WORK_QUEUE,
                     description="effectledger attempt outcomes, ambiguity notices, dead letters",
                     **common),  # type: ignore[arg-type]
    ]


async def ensure_streams(js: JetStreamContext, settings: Settings) -> None:
    """Create missing streams; never change an existing one. Changing streams is the JetStream
    API's write side, which NATS permissions give to the ledger and the apply step only, so a
    dispatcher or reconciler that tried would be refused (and wait forever for an answer)."""
    for cfg in stream_configs(settings):
        await at_startup(partial(_ensure_stream, js, cfg))


async def _ensure_stream(js: JetStreamContext, cfg: StreamConfig) -> None:
    try:
        await js.stream_info(cfg.name)  # type: ignore[arg-type]
    except NotFoundError:
        await js.add_stream(cfg)


async def delete_streams(js: JetStreamContext, settings: Settings) -> None:
    for cfg in stream_configs(settings):
        try:
            await js.delete_stream(cfg.name)  # type: ignore[arg-type]
        except NotFoundError:
            pass
