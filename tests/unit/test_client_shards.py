"""Provider calls are spread over several small connection pools (`calls.make_clients`), the
first with room taking the next call (`HttpProviderCaller`): calls one at a time keep reusing
one connection, and only calls at once spread over more pools."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from effectledger_core.catalog import Tool
from effectledger_core.digest import digest
from effectledger_core.messages import AttemptSucceeded, DispatchAttempt
from effectledger_dispatcher.ports import HttpProviderCaller
from effectledger_providers.calls import PER_CLIENT, make_clients


async def test_make_clients_covers_the_total_with_small_pools() -> None:
    clients = make_clients(130, per_client=8)
    try:
        assert len(clients) == 17  # ceil(130 / 8)
        assert len({id(c) for c in clients}) == 17
    finally:
        for c in clients:
            await c.aclose()


def test_a_caller_needs_a_client() -> None:
    with pytest.raises(ValueError, match="at least one"):
        HttpProviderCaller([], env={})
    with pytest.raises(ValueError, match="per_client"):
        HttpProviderCaller(make_clients(16), env={}, per_client=0)


class Provider:
    """A raw keep-alive HTTP server on a free local port: it records each connection's client
    port and holds every request until `release` is set."""

    def __init__(self) -> None:
        self.ports: list[int] = []
        self.held = 0
        self.arrived = asyncio.Condition()
        self.release = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.ports.append(writer.get_extra_info("peername")[1])
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                async with self.arrived:
                    self.held += 1
                    self.arrived.notify_all()
                await self.release.wait()
                writer.write(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
                             b"content-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def provider() -> AsyncIterator[tuple[Provider, str]]:
    prov = Provider()
    server = await asyncio.start_server(prov.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield prov, f"http://127.0.0.1:{port}/v1/effects"
    finally:
        server.close()


def _call(caller: HttpProviderCaller, tool: Tool, i: int) -> asyncio.Task[object]:
    arguments = {"title": f"t{i}"}
    cmd = DispatchAttempt(operation_id=f"op{i}", operation_key=f"op{i}", epoch=1, tool=tool.name,
                          arguments=arguments, arguments_digest=digest(arguments),
                          catalog_digest="sha256:test", contract_revision="r1")
    return asyncio.ensure_future(caller(tool, cmd, attempt_id=f"a{i}", dispatcher_id="d",
                                        on_sent=lambda: None))


def _tool(url: str) -> Tool:
    return Tool.model_validate({"name": "t", "endpoint": url, "contract_revision": "r1",
                                "timeout_s": 10})


async def test_calls_one_at_a_time_reuse_one_connection() -> None:
    # Taken in turn, ten calls went through eight pools and opened eight connections: an
    # agent's calls seconds apart each found its pool's connection past the keep-alive.
    async with provider() as (prov, url):
        prov.release.set()
        caller = HttpProviderCaller(make_clients(64), env={})
        try:
            assert len(caller.clients) == 8
            for i in range(10):
                assert isinstance(await _call(caller, _tool(url), i), AttemptSucceeded)
        finally:
            await caller.aclose()
        assert len(prov.ports) == 1
        assert caller.in_flight == [0] * 8


async def test_calls_at_once_fill_a_pool_before_taking_the_next() -> None:
    async with provider() as (prov, url):
        caller = HttpProviderCaller(make_clients(64), env={})
        n = 2 * PER_CLIENT + 3
        try:
            calls = [_call(caller, _tool(url), i) for i in range(n)]
            async with prov.arrived:
                await prov.arrived.wait_for(lambda: prov.held == n)
            assert caller.in_flight == [PER_CLIENT, PER_CLIENT, 3, 0, 0, 0, 0, 0]
            prov.release.set()
            assert all(isinstance(o, AttemptSucceeded) for o in await asyncio.gather(*calls))
            assert caller.in_flight == [0] * 8
        finally:
            await caller.aclose()


async def test_when_every_pool_is_at_its_share_the_least_busy_takes_the_call() -> None:
    async with provider() as (prov, url):
        caller = HttpProviderCaller(make_clients(16, per_client=2), env={}, per_client=2)
        n = 3 * len(caller.clients) + 1  # every pool past its share of 2, and one more
        try:
            calls = [_call(caller, _tool(url), i) for i in range(n)]
            async with prov.arrived:
                await prov.arrived.wait_for(lambda: prov.held == n)
            # Pools hold per_client * 2 connections each (make_clients), so all were sent.
            assert sorted(caller.in_flight) == [3] * 7 + [4]
            prov.release.set()
            await asyncio.gather(*calls)
        finally:
            await caller.aclose()
