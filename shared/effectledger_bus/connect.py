"""NATS connections from settings, for every service.

Services must outlive broker restarts: nats-py gives up after about two minutes of failed
reconnects by default, so reconnect attempts are unbounded here.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

from nats.aio.client import Client as NatsClient

from effectledger_core.config import Settings
from effectledger_obs import metrics

from .permissions import inbox_prefix

log = logging.getLogger(__name__)


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    if not (settings.nats_tls_ca_file or settings.nats_tls_cert_file):
        return None
    ctx = ssl.create_default_context(cafile=settings.nats_tls_ca_file)
    if settings.nats_tls_cert_file:
        ctx.load_cert_chain(settings.nats_tls_cert_file, settings.nats_tls_key_file)
    return ctx


def connect_options(settings: Settings, name: str) -> dict[str, Any]:
    opts: dict[str, Any] = dict(
        servers=[s.strip() for s in settings.nats_url.split(",")],
        name=name,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=1,
        connect_timeout=5,
        ping_interval=10,
        max_outstanding_pings=3,
    )
    if settings.nats_user:
        opts["user"] = settings.nats_user
        # Replies (request-reply, publish-acks) come to this user's own inbox subjects: NATS
        # permissions let each user subscribe only there (effectledger_bus.permissions).
        opts["inbox_prefix"] = inbox_prefix(settings.nats_user).encode()
    if settings.nats_password:
        opts["password"] = settings.nats_password.get_secret_value()
    if settings.nats_token:
        opts["token"] = settings.nats_token.get_secret_value()
    if settings.nats_creds_file:
        opts["user_credentials"] = settings.nats_creds_file
    ctx = tls_context(settings)
    if ctx is not None:
        opts["tls"] = ctx
    return opts


async def _log_error(exc: Exception) -> None:
    log.warning("nats: %s", exc)


async def _log_disconnect() -> None:
    metrics.NATS_CONNECTED.set(0)
    metrics.NATS_DISCONNECTS.inc()
    log.warning("nats: disconnected")


async def _log_reconnect() -> None:
    metrics.NATS_CONNECTED.set(1)
    metrics.NATS_RECONNECTS.inc()
    log.info("nats: reconnected")


async def connect(settings: Settings, name: str) -> NatsClient:
    """A connected client. With NATS unreachable this waits until it answers (attempts are
    unbounded); a service that must serve meanwhile uses `connect_client` in a task."""
    nc = NatsClient()
    await connect_client(nc, settings, name)
    return nc


async def connect_client(nc: NatsClient, settings: Settings, name: str) -> None:
    """Connect an existing client. Its object exists before the broker answers, so a service
    can hand it out (readiness checks, publishers) while this runs in the background."""
    await nc.connect(error_cb=_log_error, disconnected_cb=_log_disconnect,
                     reconnected_cb=_log_reconnect, **connect_options(settings, name))
    metrics.NATS_CONNECTED.set(1)
