"""`effectledger streams apply | show`: the one step that owns JetStream configuration."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every `effectledger` process builds this command's arguments: the rest
    # (nats-py, pydantic-settings) is imported when it runs
    from effectledger_bus import topology as topo
    from effectledger_core.config import Settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["apply", "show"],
                   help="apply: create or update every stream and consumer; show: print them")
    p.add_argument("--file", help="a topology file such as infra/nats/streams.json (default: "
                                  "the built-in definitions, identical to that file)")
    p.add_argument("--nats-url", help="NATS server(s) (env EFFECTLEDGER_NATS_URL)")
    p.add_argument("--wait", type=float, default=300.0, metavar="SECONDS",
                   help="how long to wait for NATS to answer (a starting cluster) before "
                        "failing (default 300)")


def selected(args: argparse.Namespace, settings: Settings) -> topo.Topology:
    from effectledger_bus import topology as topo

    return topo.load(args.file, settings) if args.file else topo.topology(settings)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from nats.js.errors import BadRequestError

    try:
        wanted = selected(args, settings)
    except ValueError as exc:
        print(f"effectledger streams: {exc}", file=sys.stderr)
        return 2
    if args.action == "show":
        sys.stdout.write(wanted.to_json())
        return 0
    try:
        lines = asyncio.run(asyncio.wait_for(apply(settings, wanted), args.wait))
    except TimeoutError:
        print(f"effectledger streams: NATS at {settings.nats_url} did not accept the streams "
              f"within {args.wait:.0f}s (unreachable, wrong credentials, or no JetStream "
              "leader yet)", file=sys.stderr)
        return 1
    except BadRequestError as exc:  # NATS refused a change (e.g. of retention): say which
        print(f"effectledger streams: NATS refused the change: {exc.description} "
              f"(code {exc.err_code})", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


async def apply(settings: Settings, wanted: topo.Topology) -> list[str]:
    """Apply `wanted`, waiting for a NATS that is starting (as a migration Job must)."""
    from effectledger_bus import topology as topo
    from effectledger_bus.connect import connect
    from effectledger_bus.streams import at_startup

    nc = await at_startup(lambda: connect(settings, "effectledger-streams-apply"))
    try:
        return await at_startup(lambda: topo.apply(nc.jetstream(), wanted))
    finally:
        await nc.drain()
