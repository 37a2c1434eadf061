"""The message reference: every NATS subject and payload, read from the AsyncAPI document
(`effectledger_bus.asyncapi.build`, itself generated from the pydantic models)."""

from __future__ import annotations

from typing import Any

from . import http
from .md import banner, code, prose, slug, table


def render(doc: dict[str, Any] | None = None) -> str:
    if doc is None:
        from effectledger_bus.asyncapi import build

        doc = build()
    out = ["# Message reference\n", banner("effectledger_docsgen.messages"),
           f"{prose(doc['info']['description'])} Subjects below use the default prefix `effects` "
           "(`EFFECTLEDGER_SUBJECT_PREFIX`); the same contract is in "
           "`docs/asyncapi.json` (AsyncAPI 3.0), which a test keeps equal to the code. Who "
           "may publish each subject is in [the design's trust boundaries]"
           "(../design.md#trust-boundaries).\n",
           "## Subjects\n"]
    actions = {op["channel"]["$ref"].rsplit("/", 1)[1]: op["action"]
               for op in doc["operations"].values()}
    rows = []
    for cid, channel in doc["channels"].items():
        names = [ref["$ref"].rsplit("/", 1)[1] for ref in channel["messages"].values()]
        rows.append((code(channel["address"]), actions.get(cid, ""),
                     ", ".join(f"[{n}](#{slug(n)})" for n in names),
                     prose(channel.get("description", ""))))
    out.append(table(["subject", "the ledger", "messages", "what"], rows))
    out.append("## Payloads\n")
    for name, schema in sorted(doc["components"]["schemas"].items()):
        out += http._schema(name, schema)
    return "\n".join(out)
