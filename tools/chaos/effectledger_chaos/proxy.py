"""A small asyncio TCP proxy on loopback with black-hole, reset and latency faults.

It runs as its own process (`python -m effectledger_chaos.proxy`), between the services and
NATS, PostgreSQL, the provider and the reconcilers' webhook endpoints, so that a fault can cut a
link without touching either end. Each *route* listens on one port and forwards to one or more
upstream ports (several: fail over in turn, as a load balancer would).

Faults, per route, from a line-delimited JSON control port:
- `{"op": "blackhole", "route": r, "seconds": s, "then": "resume" | "reset"}`: nothing moves in
  either direction and new connections are held, for `s` seconds. Then held traffic either
  flows on (`resume`: a partition that heals, TCP retransmits) or every connection that was held
  is reset (`reset`: the packets were dropped and the connection died). The provider link uses
  `reset`: bytes delivered long after the client gave up would apply an effect after the
  provider's processing horizon, which no provider contract allows and no oracle can bound.
- `{"op": "reset", "route": r}`: every open connection is aborted with a TCP RST, now.
- `{"op": "latency", "route": r, "ms": m, "seconds": s}`: each chunk waits `m` ms, for `s`
  seconds.
- `{"op": "stats"}`, `{"op": "clear"}`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any

CHUNK = 65536


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    held_epoch: int = -1  # the black-hole epoch this connection waited in, if any
    closed: bool = False

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        for w in (self.client, self.upstream):
            if w is not None:
                _rst(w)


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError, ValueError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(Exception):
        writer.transport.abort()


@dataclass(eq=False)
class Route:
    name: str
    listen_port: int
    upstreams: list[int]
    conns: set[_Conn] = field(default_factory=set)
    blackhole_until: float = 0.0
    blackhole_then: str = "resume"
    blackhole_epoch: int = 0
    latency_ms: float = 0.0
    latency_until: float = 0.0
    stats: dict[str, int] = field(default_factory=lambda: {
        "connections": 0, "upstream_failures": 0, "bytes": 0, "blackholes": 0, "resets": 0,
        "reset_connections": 0, "latencies": 0, "held_then_reset": 0})
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    async def gate(self, conn: _Conn) -> bool:
        """Wait out a black-hole; False if this connection must now be reset."""
        while True:
            left = self.blackhole_until - time.monotonic()
            if left <= 0:
                break
            conn.held_epoch = self.blackhole_epoch
            await asyncio.sleep(min(left, 0.2))
        if conn.held_epoch == self.blackhole_epoch and self.blackhole_then == "reset" \
                and conn.held_epoch > 0:
            return False
        return True

    async def delay(self) -> None:
        if self.latency_ms > 0 and time.monotonic() < self.latency_until:
            await asyncio.sleep(self.latency_ms / 1000)

    async def connect_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        start = next(self._rr)
        last: Exception | None = None
        for i in range(len(self.upstreams)):
            port = self.upstreams[(start + i) % len(self.upstreams)]
            try:
                return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            except (OSError, TimeoutError) as exc:
                last = exc
        raise ConnectionError(f"no upstream of {self.name} answered: {last!r}")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        self.conns.add(conn)
        self.stats["connections"] += 1
        try:
            if not await self.gate(conn):
                self.stats["held_then_reset"] += 1
                conn.abort()
                return
            try:
                up_reader, up_writer = await self.connect_upstream()
            except ConnectionError:
                self.stats["upstream_failures"] += 1
                conn.abort()
                return
            conn.upstream = up_writer
            await asyncio.gather(self._pump(conn, reader, up_writer),
                                 self._pump(conn, up_reader, writer))
        except Exception:  # a proxy must never die of one connection
            conn.abort()
        finally:
            self.conns.discard(conn)
            if not conn.closed:
                conn.closed = True
                for w in (conn.client, conn.upstream):
                    if w is not None:
                        with contextlib.suppress(Exception):
                            w.close()

    async def _pump(self, conn: _Conn, src: asyncio.StreamReader,
                    dst: asyncio.StreamWriter) -> None:
        try:
            while not conn.closed:
                data = await src.read(CHUNK)
                if not data:
                    break
                if not await self.gate(conn):
                    self.stats["held_then_reset"] += 1
                    conn.abort()
                    return
                await self.delay()
                if conn.closed:
                    return
                dst.write(data)
                self.stats["bytes"] += len(data)
                await dst.drain()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            conn.abort()
            return
        with contextlib.suppress(Exception):
            if dst.can_write_eof():
                dst.write_eof()

    # -- faults -------------------------------------------------------------------------------

    def blackhole(self, seconds: float, then: str) -> None:
        self.blackhole_epoch += 1
        self.blackhole_then = then
        self.blackhole_until = time.monotonic() + seconds
        self.stats["blackholes"] += 1

    def reset(self) -> int:
        n = 0
        for conn in list(self.conns):
            conn.abort()
            n += 1
        self.stats["resets"] += 1
        self.stats["reset_connections"] += n
        return n

    def latency(self, ms: float, seconds: float) -> None:
        self.latency_ms = ms
        self.latency_until = time.monotonic() + seconds
        self.stats["latencies"] += 1

    def clear(self) -> None:
        self.blackhole_until = 0.0
        self.latency_until = 0.0


class Proxy:
    def __init__(self, routes: list[Route]) -> None:
        self.routes = {r.name: r for r in routes}
        self.servers: list[asyncio.AbstractServer] = []

    async def start(self) -> None:
        for route in self.routes.values():
            self.servers.append(await asyncio.start_server(
                route.handle, "127.0.0.1", route.listen_port, reuse_address=True))

    def command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.get("op")
        if op == "stats":
            return {"ok": True, "routes": {n: {**r.stats, "open": len(r.conns)}
                                           for n, r in self.routes.items()}}
        if op == "clear":
            for r in self.routes.values():
                r.clear()
            return {"ok": True}
        route = self.routes.get(str(cmd.get("route")))
        if route is None:
            return {"ok": False, "error": f"unknown route {cmd.get('route')!r}"}
        if op == "blackhole":
            then = cmd.get("then", "resume")
            if then not in ("resume", "reset"):
                return {"ok": False, "error": "then must be resume or reset"}
            route.blackhole(float(cmd["seconds"]), then)
            return {"ok": True}
        if op == "reset":
            return {"ok": True, "reset": route.reset()}
        if op == "latency":
            route.latency(float(cmd["ms"]), float(cmd["seconds"]))
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    reply = self.command(json.loads(line))
                except (ValueError, KeyError, TypeError) as exc:
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


def parse_route(text: str) -> Route:
    """`name=listen:upstream[,upstream...]`."""
    name, _, rest = text.partition("=")
    listen, _, ups = rest.partition(":")
    if not name or not listen or not ups:
        raise argparse.ArgumentTypeError(f"route must be name=listen:upstream[,...]: {text!r}")
    return Route(name, int(listen), [int(u) for u in ups.split(",")])


async def _main(control_port: int, routes: list[Route]) -> None:
    proxy = Proxy(routes)
    await proxy.start()
    server = await asyncio.start_server(proxy.control, "127.0.0.1", control_port,
                                        reuse_address=True)
    print("chaos proxy ready: " + ", ".join(
        f"{r.name} {r.listen_port}->{r.upstreams}" for r in routes), flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m effectledger_chaos.proxy")
    parser.add_argument("--control", type=int, required=True, help="control port")
    parser.add_argument("--route", type=parse_route, action="append", required=True)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args.control, args.route))
    return 0


class ProxyClient:
    """The harness's side of the control port."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def command(self, **cmd: Any) -> dict[str, Any]:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", self.port), 5)
        try:
            writer.write(json.dumps(cmd).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 5)
            reply: dict[str, Any] = json.loads(line)
            return reply
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


if __name__ == "__main__":
    sys.exit(main())
