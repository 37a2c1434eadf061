"""Composition root of the dispatcher: NATS client, JetStream pull consumer, HTTP clients."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from nats.aio.client import Client as NatsClient

from effectledger_bus.connect import connect
from effectledger_bus.publish import JetStreamPublisher
from effectledger_bus.pull import PullConsumer, durable_consumer
from effectledger_bus.streams import ensure_streams
from effectledger_core.catalog import Catalog
from effectledger_core.config import Settings
from effectledger_core.heap import freeze_long_lived
from effectledger_obs import loopwatch
from effectledger_obs.http import HealthServer
from effectledger_obs.logs import announce
from effectledger_providers.adapters import load_adapter
from effectledger_providers.calls import make_clients

from .ports import HttpProviderCaller, NatsLedgerClient
from .worker import CONSUMER, Dispatcher

log = logging.getLogger("effectledger.dispatcher")


def build_consumer(nc: NatsClient, settings: Settings, dispatcher: Dispatcher) -> PullConsumer:
    """The durable `dispatcher` pull consumer of the dispatch stream (plain nats-py; see
    effectledger_bus.pull for why not FastStream here)."""
    return durable_consumer(nc, settings, CONSUMER, dispatcher.handle, name="dispatcher",
                            concurrency=settings.dispatcher_concurrency,
                            batch=min(256, settings.dispatcher_concurrency))


async def serve(settings: Settings, *, started: asyncio.Event | None = None) -> None:
    catalog = Catalog.load(settings.catalog_path)
    for tool in catalog.tools.values():
        load_adapter(tool)  # a bad adapter path fails the deployment, not each operation
    nc = await connect(settings, f"effectledger-dispatcher-{settings.dispatcher_id}")
    await ensure_streams(nc.jetstream(), settings)
    env = dict(os.environ)
    caller = HttpProviderCaller(make_clients(max(16, settings.dispatcher_concurrency * 2)),
                                env=env)
    dispatcher = Dispatcher(
        ledger=NatsLedgerClient(nc, settings.subjects, dispatcher_id=settings.dispatcher_id,
                                timeout_s=settings.claim_timeout_s),
        publisher=JetStreamPublisher(nc.jetstream()), call=caller, catalog=catalog,
        subjects=settings.subjects, dispatcher_id=settings.dispatcher_id,
        ack_wait_s=settings.ack_wait_s, max_deliver=settings.max_deliver, env=env,
        outcome_request_s=settings.dispatcher_outcome_request_timeout_s)
    consumer = build_consumer(nc, settings, dispatcher)
    await consumer.start()
    health = None
    if settings.dispatcher_health_port is not None:
        async def ready() -> dict[str, bool]:
            return {"nats": nc.is_connected}

        health = HealthServer(ready, host=settings.dispatcher_health_host,
                              port=settings.dispatcher_health_port,
                              setting="EFFECTLEDGER_DISPATCHER_HEALTH_PORT")
        port = await health.start()
        log.info("dispatcher health and metrics on http://%s:%d",
                 settings.dispatcher_health_host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    freeze_long_lived(collect=False)  # what start-up made lives as long as the process
    loopwatch.start()  # GC pauses and loop lag as metrics: the tail's evidence
    announce(f"dispatcher ready: {settings.dispatcher_id}")
    if started is not None:
        started.set()
    try:
        await stop.wait()
    finally:
        if health is not None:
            await health.stop()
        await consumer.stop()
        await caller.aclose()
        with contextlib.suppress(Exception):
            await nc.drain()
