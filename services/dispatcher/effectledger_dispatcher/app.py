"""Composition root of the dispatcher: NATS client, FastStream consumer, HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from faststream import AckPolicy
from faststream.nats import JStream, NatsBroker, PullSub
from nats.js.api import AckPolicy as JsAckPolicy
from nats.js.api import ConsumerConfig

from effectledger_bus.connect import connect, connect_options, current_message, raw_body
from effectledger_bus.streams import ensure_streams
from effectledger_core.catalog import Catalog
from effectledger_core.config import Settings

from .adapters import load_adapter
from .provider import make_clients
from .worker import CONSUMER, Dispatcher, as_delivery

log = logging.getLogger("effectledger.dispatcher")


def build_broker(settings: Settings, dispatcher: Dispatcher) -> NatsBroker:
    subjects = settings.subjects
    broker = NatsBroker(**connect_options(settings, f"effectledger-dispatcher-"
                                                    f"{settings.dispatcher_id}"),
                        logger=log, log_level=logging.DEBUG, decoder=raw_body)

    @broker.subscriber(
        subjects.dispatch_all,
        stream=JStream(subjects.dispatch_stream, declare=False),
        durable=CONSUMER,
        pull_sub=PullSub(batch_size=min(256, settings.dispatcher_concurrency), timeout=1.0),
        max_workers=settings.dispatcher_concurrency,
        ack_policy=AckPolicy.MANUAL,
        config=ConsumerConfig(
            ack_policy=JsAckPolicy.EXPLICIT,
            # ack_wait bounds how long a silently dead dispatcher holds a command; live ones
            # send in_progress heartbeats during provider calls.
            ack_wait=settings.ack_wait_s,
            max_deliver=settings.max_deliver,
            max_ack_pending=max(1024, settings.dispatcher_concurrency * 4)),
        title="dispatcher", description="Dispatch commands from the ledger outbox")
    async def on_dispatch(body: bytes) -> None:
        msg = current_message(broker)  # not a parameter: see current_message
        await dispatcher.handle(as_delivery(msg))

    return broker


async def serve(settings: Settings, *, started: asyncio.Event | None = None) -> None:
    catalog = Catalog.load(settings.catalog_path)
    for tool in catalog.tools.values():
        load_adapter(tool)  # a bad adapter path fails the deployment, not each operation
    nc = await connect(settings, f"effectledger-dispatcher-{settings.dispatcher_id}")
    await ensure_streams(nc.jetstream(), settings)
    pool = make_clients(max(16, settings.dispatcher_concurrency * 2))
    http = pool[0]
    dispatcher = Dispatcher(nc=nc, http=http, http_pool=pool, catalog=catalog,
                            subjects=settings.subjects,
                            dispatcher_id=settings.dispatcher_id,
                            claim_timeout_s=settings.claim_timeout_s,
                            ack_wait_s=settings.ack_wait_s, max_deliver=settings.max_deliver)
    broker = build_broker(settings, dispatcher)
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    print(f"dispatcher ready: {settings.dispatcher_id}", flush=True)
    if started is not None:
        started.set()
    try:
        await stop.wait()
    finally:
        await broker.stop()
        for client in pool:
            await client.aclose()
        with contextlib.suppress(Exception):
            await nc.drain()
