"""What a service checks about its streams at start; it never changes an existing one.

The streams and consumers are owned by one step, `effectledger streams apply`
(`effectledger_bus.topology`, `infra/nats/streams.json`). A service only checks that each stream
it needs exists and matches in the fields that decide correctness (its subjects, work-queue
retention, a message size our bounded messages fit in); replicas, limits and placement are the
operator's and are left as they are. A missing stream is created from the same definitions
when `EFFECTLEDGER_STREAMS_CREATE_MISSING` is true (the default, for a developer's embedded
NATS); deployments set it to false so that a stream exists only once the apply step made it.
File storage by default: the dispatch stream is the transport of committed intents, so it
should survive a broker restart (the ledger's sweeper repairs what is lost anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

from effectledger_core.config import Settings
from effectledger_core.errors import ConfigError

from .topology import MAX_MSG_SIZE, topology

log = logging.getLogger(__name__)
T = TypeVar("T")


class StreamMissing(ConfigError):
    """A stream this service needs does not exist and it may not create it: waited for, as
    the deployment's `streams apply` step may simply not have run yet."""


def _transient(exc: BaseException) -> bool:
    """Worth waiting out at start-up: the server is unreachable, restarting or electing. A
    refused configuration (400) is our mistake and must fail the start at once."""
    if isinstance(exc, StreamMissing):
        return True
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
    return topology(settings).streams


def stream_problems(actual: StreamConfig, wanted: StreamConfig) -> list[str]:
    """What makes an existing stream unusable for us (empty: usable). Replicas, storage, age
    and duplicate window are the operator's choice and are not compared."""
    problems = []
    missing = sorted(set(wanted.subjects or []) - set(actual.subjects or []))
    if missing:
        problems.append(f"does not capture subjects {missing}")
    if _value(actual.retention) != _value(wanted.retention):
        problems.append(f"has retention {_value(actual.retention)}, needs "
                        f"{_value(wanted.retention)}")
    size = actual.max_msg_size
    if size is not None and 0 < size < MAX_MSG_SIZE:
        problems.append(f"has max_msg_size {size}, needs at least {MAX_MSG_SIZE}")
    return problems


def _value(policy: RetentionPolicy | str | None) -> str:
    # nats-py leaves the server's answer as a plain string, our definitions use the enum
    return "unset" if policy is None else str(getattr(policy, "value", policy))


async def ensure_streams(js: JetStreamContext, settings: Settings) -> None:
    """Check (and, when allowed, create) every stream; never change one: changing streams
    is the JetStream API's write side, which NATS permissions give to the ledger and the
    apply step only. ConfigError in one line when a stream is unusable."""
    for cfg in stream_configs(settings):
        await at_startup(partial(_check_stream, js, cfg, settings.streams_create_missing))


async def _check_stream(js: JetStreamContext, cfg: StreamConfig, create_missing: bool) -> None:
    name = cfg.name or ""
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        if not create_missing:
            raise StreamMissing(f"JetStream stream {name} does not exist yet: waiting for "
                                "`effectledger streams apply`") from None
        try:
            await js.add_stream(cfg)
        except BadRequestError as exc:  # another service created it a moment ago
            if exc.err_code != 10058:  # "stream name already in use"
                raise
            info = await js.stream_info(name)
        else:
            log.info("created JetStream stream %s (it did not exist)", name)
            return
    problems = stream_problems(info.config, cfg)
    if problems:
        raise ConfigError(f"JetStream stream {name} {'; '.join(problems)}: fix it with "
                          "`effectledger streams apply`")
    if info.config.num_replicas != cfg.num_replicas:
        log.info("stream %s has %s replicas (configured: %s); left as it is: "
                 "`effectledger streams apply` changes it", name, info.config.num_replicas,
                 cfg.num_replicas)


async def delete_streams(js: JetStreamContext, settings: Settings) -> None:
    for cfg in stream_configs(settings):
        try:
            await js.delete_stream(cfg.name)  # type: ignore[arg-type]
        except NotFoundError:
            pass
