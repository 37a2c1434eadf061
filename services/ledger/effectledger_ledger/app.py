"""Composition root of the ledger service: store, catalog, inbox, relay, sweeper, HTTP API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import uvicorn
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from effectledger_bus.connect import connect_client
from effectledger_bus.httpedge import server_config
from effectledger_bus.pull import PullConsumer
from effectledger_bus.rpc import RequestServer
from effectledger_bus.streams import ensure_streams
from effectledger_core.catalog import Catalog
from effectledger_core.config import Settings
from effectledger_core.heap import freeze_long_lived
from effectledger_core.quotas import QuotaLimits
from effectledger_obs import loopwatch
from effectledger_obs.logs import announce

from .api import create_app
from .auth import Authenticator
from .db.outbox import StreamPosition
from .db.store import Store
from .db.warmup import warm
from .gauges import DbGauges
from .messaging import build_inbox, serve_requests
from .migrate import upgrade_when_reachable
from .peers import Peers
from .relay import DirectPublisher, Relay, Sweeper, stream_position
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

    # Before it listens: the first batches after a (re)start must not pay for cold connections
    # and first compiles while agents wait (db/warmup.py). One connection per batch worker and
    # one for the express lane; SQLite has one connection.
    busy = min(settings.db_pool_size, service.writes.workers + 1)
    await warm(store, catalog, settings.subjects, connections=busy if store.is_postgres else 1)

    # The database is the ledger's only hard dependency: it listens and accepts intents,
    # approvals and reads while NATS is down or not yet reachable. The outbox keeps every
    # command; the NATS side connects in the background and catches up.
    plane = NatsPlane(settings, service, store)
    plane_task = asyncio.create_task(plane.run(), name="nats-plane")
    janitor = asyncio.create_task(_janitor(store, settings), name="janitor")
    # The ledger's one listening connection (peers.py; none on SQLite): any replica's new
    # outbox rows wake the relay, and another replica's commit wakes this one's waits at once,
    # not at the re-check (nothing is sent while this ledger is alone).
    peers = Peers(store, service.waiters, deployment=settings.subjects.prefix,
                  outbox_wake=service.outbox_wake)
    service.commit_hooks.append(peers.committed)
    peers_task = asyncio.create_task(peers.run(), name="peers")

    async def ready() -> dict[str, bool]:
        return {"database": await store.ping(), "nats": plane.nc.is_connected,
                "relay": plane.relay_running()}

    gauges = DbGauges(store, reconcile_deadline_s=settings.reconcile_deadline_s)
    app = create_app(service, ready=ready,
                     auth=Authenticator(settings.agent_tokens, settings.operator_tokens),
                     max_wait_s=settings.wait_max_s, before_scrape=gauges.refresh)
    server = uvicorn.Server(server_config(
        app, host=settings.ledger_host, port=settings.ledger_port, log_level="warning",
        access_log=False, lifespan="off", header_timeout_s=settings.http_header_timeout_s,
        body_timeout_s=settings.http_body_timeout_s, keepalive_s=settings.http_keepalive_s,
        log_config=None))  # our log handlers and format, not uvicorn's
    watcher = asyncio.create_task(_announce(server, settings, plane_task, started))
    try:
        await server.serve()
    finally:
        watcher.cancel()
        for t in (plane_task, janitor, peers_task):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await plane.close()
        await service.close()
        await store.close()


class NatsPlane:
    """Everything of the ledger that needs NATS: request-reply, the inbox, the relay, the
    sweeper and direct publishing. Started once the broker answers, however long that takes;
    until then intents go to the outbox only, and the relay publishes them on connection."""

    def __init__(self, settings: Settings, service: LedgerService, store: Store) -> None:
        self.settings, self.service, self.store = settings, service, store
        self.nc = NatsClient()
        self.tasks: list[asyncio.Task[None]] = []
        self.inbox: PullConsumer | None = None
        self.requests: RequestServer | None = None

    def relay_running(self) -> bool:
        """The relay and the sweeper started and neither ended."""
        return bool(self.tasks) and not any(t.done() for t in self.tasks)

    async def run(self) -> None:
        try:
            await self._start()
        except asyncio.CancelledError:
            raise
        except Exception:
            # The HTTP side keeps serving; /readyz/relay reports the relay as not running.
            log.exception("ledger NATS side failed to start")
            raise

    async def _start(self) -> None:
        settings, service, store = self.settings, self.service, self.store
        await connect_client(self.nc, settings, "effectledger-ledger-relay")
        js = self.nc.jetstream()
        await _until_done("stream setup", lambda: ensure_streams(js, settings))
        self.inbox = build_inbox(self.nc, settings, service)
        await _until_done("inbox start", self.inbox.start)
        self.requests = await serve_requests(self.nc, settings, service)
        if settings.direct_publish_lease_s > 0:
            service.direct_lease_s = settings.direct_publish_lease_s
            service.publish_with_commit = settings.direct_publish_with_commit
            service.publisher = DirectPublisher(
                js, service.writes, store, service.outbox_wake,
                mark_linger_s=min(settings.direct_publish_mark_linger_s,
                                  settings.direct_publish_lease_s / 4))
        relay = Relay(store, js, service.outbox_wake, batch_size=settings.relay_batch_size,
                      lease_s=settings.relay_lease_s,
                      poll_interval_s=settings.relay_poll_interval_s)
        sweeper = Sweeper(store, service.outbox_wake, older_than_s=settings.sweep_after_s,
                          interval_s=settings.sweep_interval_s,
                          reconcile_after_s=settings.reconcile_sweep_after_s,
                          positions=lambda: _positions(js, settings),
                          repair_lost_outcomes=lambda: service.repair_lost_outcomes(
                              settings.lost_outcome_after_s))
        self.tasks = [asyncio.create_task(relay.run(), name="relay"),
                      asyncio.create_task(sweeper.run(), name="sweeper")]
        service.outbox_wake.set()  # what was accepted while NATS was away goes out now
        log.info("ledger connected to NATS: relay, inbox and request-reply running")

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.requests is not None:
            await self.requests.close()
        if self.inbox is not None:
            await self.inbox.stop()
        with contextlib.suppress(Exception):
            if self.nc.is_connected:
                await self.nc.drain()
            else:
                await self.nc.close()


async def _until_done(what: str, step: Callable[[], Awaitable[object]]) -> None:
    """Retry a start-up step the broker can refuse (it may go away right after connecting)."""
    delay = 0.5
    while True:
        try:
            await step()
            return
        except Exception as exc:  # timeouts, a broker that went away again
            log.warning("ledger NATS %s failed (%s); retrying in %.1fs", what, exc, delay)
        await asyncio.sleep(delay)  # a backoff between tries, not synchronisation
        delay = min(delay * 2, 10.0)


async def _announce(server: uvicorn.Server, settings: Settings, plane: asyncio.Task[None],
                    started: asyncio.Event | None) -> None:
    """"ledger listening" once HTTP serves (intents accepted from then on); "ledger ready"
    once the NATS side runs too."""
    while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
        await asyncio.sleep(0.02)  # polling uvicorn's flag; it offers no event to wait on
    url = f"http://{settings.ledger_host}:{settings.ledger_port}"
    log.info("ledger listening on %s", url)
    announce(f"ledger listening: {url}")
    await plane
    freeze_long_lived(collect=False)  # what start-up made lives as long as the process
    loopwatch.start()  # GC pauses and loop lag as metrics: the tail's evidence
    announce(f"ledger ready: {url}")
    if started is not None:
        started.set()


async def _janitor(store: Store, settings: Settings) -> None:
    """Drops deduplication state once no redelivery can need it, and settled outbox rows once
    their retention has passed (every `janitor_interval_s`, hourly by default)."""
    while True:
        try:
            purged = await janitor_pass(store, settings)
            if any(purged.values()):
                log.info("janitor purged %s", purged)
        except Exception:
            log.exception("janitor failed; will retry")
        await asyncio.sleep(settings.janitor_interval_s)  # a period, not synchronisation


async def janitor_pass(store: Store, settings: Settings, *, batch: int = 1000
                       ) -> dict[str, int]:
    """One pass of the janitor; the outbox goes in bounded transactions of `batch` rows."""
    from effectledger_core.ids import utcnow
    from effectledger_obs import metrics

    from .db.retention import purge_outbox_txn
    from .db.reviews import purge_expired_txn

    now = utcnow()
    purged = await store.run(purge_expired_txn, now=now,
                             inbox_retention_s=settings.inbox_retention_s,
                             webhook_retention_s=settings.webhook_retention_s)
    outbox_rows = 0
    if settings.outbox_retention_s > 0:
        while True:
            n = await store.run(purge_outbox_txn, now=now,
                                retention_s=settings.outbox_retention_s, limit=batch)
            outbox_rows += n
            if n < batch:
                break
    metrics.OUTBOX_PURGED.inc(outbox_rows)
    return {**purged, "outbox": outbox_rows}


async def _positions(js: JetStreamContext, settings: Settings
                     ) -> dict[str, StreamPosition | None]:
    subjects = settings.subjects
    return {"dispatch": await stream_position(js, subjects.dispatch_stream, "dispatcher"),
            "reconcile": await stream_position(js, subjects.events_stream, "reconciler")}
