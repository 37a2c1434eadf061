"""Composition root of the reconciler: NATS, the reconcile consumer and the webhook HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping

import uvicorn
from nats.aio.client import Client as NatsClient
from starlette.applications import Starlette

from effectledger_bus.connect import connect_client
from effectledger_bus.httpedge import server_config
from effectledger_bus.publish import JetStreamPublisher
from effectledger_bus.pull import PullConsumer, durable_consumer
from effectledger_bus.streams import ensure_streams
from effectledger_core import unsafe
from effectledger_core.catalog import Catalog
from effectledger_core.config import Settings
from effectledger_core.heap import freeze_long_lived
from effectledger_obs.logs import announce
from effectledger_providers.adapters import load_adapter
from effectledger_providers.calls import make_client

from .decisions import Timing
from .ledger_client import NatsLedgerClient
from .native import NativeWebhooks
from .signatures import WebhookVerifier
from .webhooks import create_app
from .worker import CONSUMER, Reconciler, http_readback

log = logging.getLogger("effectledger.reconciler")
CONCURRENCY = 32


def skip_verification_requested(env: Mapping[str, str] | None = None) -> bool:
    return unsafe.armed(unsafe.SKIP_WEBHOOK_VERIFICATION, env if env is not None else os.environ)


def build_verifier(settings: Settings, *, skip: bool = False) -> WebhookVerifier:
    secrets = {p: [s.get_secret_value() for s in values]
               for p, values in settings.webhook_secrets.items()}
    return WebhookVerifier(secrets, tolerance_s=settings.webhook_tolerance_s,
                           skip_verification=skip)


def build_consumer(nc: NatsClient, settings: Settings, reconciler: Reconciler) -> PullConsumer:
    """The durable `reconciler` pull consumer of reconcile commands, on the same edge as the
    dispatcher's and the inbox's (effectledger_bus.pull)."""
    return durable_consumer(nc, settings, CONSUMER, reconciler.handle, name="reconciler",
                            concurrency=CONCURRENCY, batch=CONCURRENCY)


async def serve(settings: Settings, *, started: asyncio.Event | None = None) -> None:
    catalog = Catalog.load(settings.catalog_path)
    for tool in catalog.tools.values():
        load_adapter(tool)  # a bad adapter path fails the deployment, not each operation
    skip = skip_verification_requested()
    verifier = build_verifier(settings, skip=skip)  # bad secrets fail before connecting
    native = NativeWebhooks.from_catalog(catalog, os.environ)  # so do missing native secrets
    if not verifier.providers and not native.providers and not skip:
        log.warning("no webhook secrets configured (EFFECTLEDGER_WEBHOOK_SECRETS): every "
                    "webhook will be refused")
    # The client exists before the broker answers: the webhook endpoint listens from the
    # start and answers 503 + Retry-After until NATS is connected (see webhooks.py).
    nc = NatsClient()
    publisher = JetStreamPublisher(nc.jetstream())
    http = make_client(max_connections=CONCURRENCY * 2)
    reconciler = Reconciler(
        ledger=NatsLedgerClient(nc, settings.subjects), publisher=publisher, catalog=catalog,
        subjects=settings.subjects, reconciler_id=settings.reconciler_id,
        readback=http_readback(http, dict(os.environ)),
        timing=Timing(reconcile_deadline_s=settings.reconcile_deadline_s,
                      webhook_wait_s=settings.webhook_wait_s,
                      audit_slack_s=settings.audit_slack_s))
    consumer = build_consumer(nc, settings, reconciler)

    async def ready() -> dict[str, bool]:
        return {"nats": nc.is_connected}

    app = create_app(verifier=verifier, publisher=publisher, subjects=settings.subjects,
                     max_body_bytes=settings.webhook_max_body_bytes, ready=ready,
                     native=native)
    app.state.reconciler = reconciler
    listening = asyncio.Event()
    nats_side = asyncio.create_task(_start_nats(nc, settings, consumer), name="nats")
    announcer = asyncio.create_task(_announce(settings, listening, nats_side, started))
    try:
        await _serve_http(app, settings, listening)
    finally:
        for t in (announcer, nats_side):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await consumer.stop()
        await http.aclose()
        with contextlib.suppress(Exception):
            await nc.drain()


async def _start_nats(nc: NatsClient, settings: Settings, consumer: PullConsumer) -> None:
    """Connect (waiting as long as the broker is away), then consume reconcile commands."""
    await connect_client(nc, settings, f"effectledger-reconciler-{settings.reconciler_id}")
    delay = 0.5
    while True:
        try:
            await ensure_streams(nc.jetstream(), settings)
            await consumer.start()
            break
        except Exception as exc:  # the broker went away again right after connecting
            log.warning("reconciler NATS start failed (%s); retrying in %.1fs", exc, delay)
        await asyncio.sleep(delay)  # a backoff between tries, not synchronisation
        delay = min(delay * 2, 10.0)
    log.info("reconciler %s connected to NATS", settings.reconciler_id)


async def _announce(settings: Settings, listening: asyncio.Event,
                    nats_side: asyncio.Task[None], started: asyncio.Event | None) -> None:
    """"reconciler ready" once the webhook endpoint listens and NATS is connected."""
    await listening.wait()
    await nats_side
    url = f"http://{settings.reconciler_host}:{settings.reconciler_port}"
    freeze_long_lived(collect=False)  # what start-up made lives as long as the process
    announce(f"reconciler ready: {url} ({settings.reconciler_id})")
    if started is not None:
        started.set()


async def _serve_http(app: Starlette, settings: Settings, listening: asyncio.Event) -> None:
    """Run uvicorn until it stops (SIGINT/SIGTERM, handled by uvicorn) or is cancelled."""
    server = uvicorn.Server(server_config(
        app, host=settings.reconciler_host, port=settings.reconciler_port, log_level="warning",
        access_log=False, lifespan="off", header_timeout_s=settings.http_header_timeout_s,
        body_timeout_s=settings.http_body_timeout_s, keepalive_s=settings.http_keepalive_s,
        log_config=None))  # our log handlers and format, not uvicorn's
    task = asyncio.create_task(_run(server, settings))
    try:
        while not server.started:  # uvicorn exposes a flag, not an event
            if task.done():
                task.result()  # a failed start surfaces here
                return
            await asyncio.sleep(0.02)
        url = f"http://{settings.reconciler_host}:{settings.reconciler_port}"
        log.info("reconciler %s listening on %s", settings.reconciler_id, url)
        announce(f"reconciler listening: {url} ({settings.reconciler_id})")
        listening.set()
        await asyncio.shield(task)
    except asyncio.CancelledError:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await task
        raise


async def _run(server: uvicorn.Server, settings: Settings) -> None:
    try:
        await server.serve()
    except SystemExit as exc:  # uvicorn exits the process when it cannot bind
        raise RuntimeError(f"reconciler could not listen on {settings.reconciler_host}:"
                           f"{settings.reconciler_port}") from exc
