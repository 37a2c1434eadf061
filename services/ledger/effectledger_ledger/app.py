"""Composition root of the ledger service: store, catalog, inbox, relay, sweeper, HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn
from nats.js import JetStreamContext

from effectledger_bus.connect import connect
from effectledger_bus.httpedge import server_config
from effectledger_bus.streams import ensure_streams
from effectledger_core.catalog import Catalog
from effectledger_core.config import Settings
from effectledger_core.quotas import QuotaLimits
from effectledger_obs.logs import announce

from .api import create_app
from .auth import Authenticator
from .db.outbox import StreamPosition
from .db.store import Store
from .gauges import DbGauges
from .messaging import build_inbox, serve_requests
from .migrate import upgrade_when_reachable
from .relay import DirectPublisher, Relay, Sweeper, listen_notify, stream_position
from .service import LedgerService

log = logging.getLogger("effectledger.ledger")


async def serve(settings: Settings, *, started: asyncio.Event | None = None) -> None:
    catalog = Catalog.load(settings.catalog_path)  # invalid catalogs fail before anything runs
    store = Store(settings.database_url, pool_size=settings.db_pool_size)
    if settings.auto_migrate:
        await upgrade_when_reachable(store, wait_s=settings.db_startup_wait_s)
    service = LedgerService(store=store, catalog=catalog, subjects=settings.subjects,
                            batch_max=settings.db_batch_max,
                            batch_workers=settings.db_batch_workers,
                            quotas=QuotaLimits(
                                rate_per_s=settings.tenant_rate_per_s,
                                burst=settings.tenant_burst,
                                max_in_flight=settings.tenant_max_in_flight,
                                max_awaiting_approval=settings.tenant_max_awaiting_approval),
                            wait_recheck_s=settings.wait_recheck_s)

    nc = await connect(settings, "effectledger-ledger-relay")
    js = nc.jetstream()
    await ensure_streams(js, settings)
    if settings.direct_publish_lease_s > 0:
        service.publisher = DirectPublisher(js, service.writes, store, service.outbox_wake)
        service.direct_lease_s = settings.direct_publish_lease_s
    inbox = build_inbox(nc, settings, service)
    await inbox.start()
    requests = await serve_requests(nc, settings, service)

    relay = Relay(store, js, service.outbox_wake, batch_size=settings.relay_batch_size,
                  lease_s=settings.relay_lease_s, poll_interval_s=settings.relay_poll_interval_s)
    sweeper = Sweeper(store, service.outbox_wake, older_than_s=settings.sweep_after_s,
                      interval_s=settings.sweep_interval_s,
                      reconcile_after_s=settings.reconcile_sweep_after_s,
                      positions=lambda: _positions(js, settings),
                      repair_lost_outcomes=lambda: service.repair_lost_outcomes(
                          settings.lost_outcome_after_s))
    tasks = [asyncio.create_task(relay.run(), name="relay"),
             asyncio.create_task(sweeper.run(), name="sweeper"),
             asyncio.create_task(_janitor(store, settings), name="janitor"),
             asyncio.create_task(listen_notify(store, service.outbox_wake), name="listen")]

    async def ready() -> dict[str, bool]:
        return {"database": await store.ping(), "nats": nc.is_connected,
                "relay": not any(t.done() for t in tasks[:3])}

    gauges = DbGauges(store, reconcile_deadline_s=settings.reconcile_deadline_s)
    app = create_app(service, ready=ready,
                     auth=Authenticator(settings.agent_tokens, settings.operator_tokens),
                     max_wait_s=settings.wait_max_s, before_scrape=gauges.refresh)
    server = uvicorn.Server(server_config(
        app, host=settings.ledger_host, port=settings.ledger_port, log_level="warning",
        access_log=False, lifespan="off", header_timeout_s=settings.http_header_timeout_s,
        body_timeout_s=settings.http_body_timeout_s,
        log_config=None))  # our log handlers and format, not uvicorn's
    watcher = asyncio.create_task(_announce(server, settings, started))
    try:
        await server.serve()
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await requests.close()
        await inbox.stop()
        with contextlib.suppress(Exception):
            await nc.drain()
        await service.close()
        await store.close()


async def _announce(server: uvicorn.Server, settings: Settings,
                    started: asyncio.Event | None) -> None:
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
        await asyncio.sleep(0.02)  # polling uvicorn's flag; it offers no event to wait on
    log.info("ledger listening on http://%s:%d", settings.ledger_host, settings.ledger_port)
    announce(f"ledger ready: http://{settings.ledger_host}:{settings.ledger_port}")
    if started is not None:
        started.set()


async def _janitor(store: Store, settings: Settings) -> None:
    """Drops deduplication state once no redelivery can need it (hourly)."""
    from effectledger_core.ids import utcnow

    from .db.reviews import purge_expired_txn

    while True:
        try:
            purged = await store.run(purge_expired_txn, now=utcnow(),
                                     inbox_retention_s=settings.inbox_retention_s,
                                     webhook_retention_s=settings.webhook_retention_s)
            if any(purged.values()):
                log.info("janitor purged %s", purged)
        except Exception:
            log.exception("janitor failed; will retry")
        await asyncio.sleep(3600)  # a period, not synchronisation


async def _positions(js: JetStreamContext, settings: Settings
                     ) -> dict[str, StreamPosition | None]:
    subjects = settings.subjects
    return {"dispatch": await stream_position(js, subjects.dispatch_stream, "dispatcher"),
            "reconcile": await stream_position(js, subjects.events_stream, "reconciler")}
