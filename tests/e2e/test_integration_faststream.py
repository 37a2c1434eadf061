"""FastStream on effectledger (issue 29): a FastStream app with `LedgerRouter` against a real
nats-server and a running ledger, dispatcher and sandbox provider: on the machine's shared
server, and on a private server configured as `effectledger up` configures it, connected as the
tenant's least-privilege agent user."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

pytest.importorskip("faststream", reason="faststream is not installed: pip install -e "
                    "'.[integrations]'")

from faststream.nats import NatsBroker
from faststream.security import SASLPlaintext

from effectledger_bus import permissions
from effectledger_core.config import Settings
from effectledger_core.messages import OperationReply, SubmitIntent
from effectledger_integrations.faststream import LedgerRouter, LedgerUnanswered
from tests.support import agentstack
from tests.support.cluster import Cluster, wait_until
from tests.support.natsauth import private_broker

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]
AGENT = "agent-acme"


@asynccontextmanager
async def _app(url: str, settings: Settings, errors: list[str], *, user: str | None = None,
               password: str | None = None) -> AsyncIterator[
                   tuple[LedgerRouter, list[OperationReply], LedgerRouter]]:
    """A FastStream app with the router, connected (as `user` when given); its settled
    operations are collected."""
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    security = SASLPlaintext(username=user, password=password) if user and password else None
    broker = NatsBroker(url, security=security, error_cb=on_error,
                        inbox_prefix=permissions.inbox_prefix(AGENT))
    ledger = LedgerRouter("acme", subjects=settings.subjects, wait_s=10)
    settled: list[OperationReply] = []

    @ledger.on_settled
    async def collect(reply: OperationReply) -> None:
        settled.append(reply)

    broker.include_router(ledger)
    # A router for another tenant on this connection: the credentials, not the router, decide.
    other = LedgerRouter("globex", subjects=settings.subjects, request_timeout_s=2,
                         inbox_prefix=permissions.inbox_prefix(AGENT))
    broker.include_router(other)
    await broker.start()
    try:
        yield ledger, settled, other
    finally:
        await broker.stop()


async def _submit_twice_one_effect(c: Cluster, ledger: LedgerRouter,
                                   settled: list[OperationReply]) -> None:
    before = await agentstack.applied(c)
    intent = SubmitIntent(tool="create_ticket", arguments={"title": "from faststream"},
                          idempotency_key="order-17")
    first = await ledger.submit(intent)
    assert first.created is True
    await wait_until(lambda: settled, 30, what="the settled operation")
    (done,) = settled
    assert done.operation.id == first.operation.id and done.operation.state == "succeeded"
    # The same intent again (a resend after a lost answer): the same operation, one effect,
    # and its settled answer once more.
    again = await ledger.submit(intent)
    assert again.created is False and again.operation.id == first.operation.id
    await wait_until(lambda: len(settled) == 2, 30, what="the second answer")
    assert settled[1].operation.id == first.operation.id
    assert await agentstack.applied(c) == before + 1
    op = await c.operation(first.operation.id)
    assert op["tenant"] == "acme" and op["caller_key"] == "order-17"


async def test_faststream_app_on_the_shared_nats_server(
        settings: Settings, make_cluster: Callable[..., Cluster]) -> None:
    """On the machine's nats-server (no users): an intent from the FastStream app is applied
    once, its settled operation arrives as an `OperationReply`, a resend with the same key is
    the same operation."""
    c = make_cluster()
    await c.start()
    errors: list[str] = []
    async with _app(settings.nats_url, settings, errors) as (ledger, settled, _):
        await _submit_twice_one_effect(c, ledger, settled)
    assert errors == []


async def test_faststream_app_as_the_least_privilege_agent_user(
        settings: Settings, tmp_path: Path, make_cluster: Callable[..., Cluster]) -> None:
    """Connected as `agent-acme` to a nats-server with `effectledger up`'s users and
    permissions (the ledger and the dispatcher each with their own user): the same, with no
    permissions violation reported to the app; a router for another tenant on these
    credentials is refused by NATS and applies nothing."""
    with private_broker(tmp_path, settings.subjects) as broker:
        c = make_cluster(env={"EFFECTLEDGER_NATS_URL": broker.url})
        await c.start_sandbox()
        await c.start_ledger(env=broker.env("ledger"))
        await c.start_dispatcher("dispatcher", env=broker.env("dispatcher-dispatcher"))
        cred = broker.files.credentials[AGENT]
        errors: list[str] = []
        async with _app(broker.url, settings, errors, user=cred.user,
                        password=cred.password) as (ledger, settled, other):
            await _submit_twice_one_effect(c, ledger, settled)
            assert errors == []
            # Another tenant's intents subject: NATS refuses the publish, nothing is applied.
            before = await agentstack.applied(c)
            with pytest.raises(LedgerUnanswered):
                await other.submit(SubmitIntent(tool="create_ticket", idempotency_key="x-1"))
            subject = settings.subjects.rpc_intents_for("globex").lower()
            assert any("permissions violation" in e.lower() and subject in e.lower()
                       for e in errors), errors
            assert await agentstack.applied(c) == before
