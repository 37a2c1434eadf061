"""The message contract as an AsyncAPI 3 document, generated from the message catalogue
(`effectledger_bus.catalogue`: channels, routes) and the pydantic models (payloads).

`python -m effectledger_bus.asyncapi > docs/asyncapi.json` regenerates the committed copy; a test
fails when the two differ, so the documented contract cannot drift from the code.

Built from the models here rather than by FastStream's generator: declaring the channels on a
FastStream broker gives one merged payload per channel (a request and its replies become one
anonymous union) and a `correlation_id` header that the services, on nats-py, never send. This
document names every message, and the replies of each request-reply subject.
"""

from __future__ import annotations

import json
from typing import Any

from effectledger_core.subjects import Subjects

from . import catalogue


def build(subjects: Subjects | None = None) -> dict[str, Any]:
    subjects = subjects or Subjects()
    doc: dict[str, Any] = {
        "asyncapi": "3.0.0",
        "info": {"title": "effectledger message contract", "version": "1",
                 "description": "Subjects are versioned (v1). Every message is JSON with "
                                "schema_version: 1 and rejects unknown fields."},
        "channels": {}, "operations": {}, "components": {"messages": {}, "schemas": {}},
    }
    for channel in catalogue.CHANNELS:
        cid = channel.id
        refs = {}
        for model in catalogue.models_to(channel):
            name = model.__name__
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for dname, dschema in schema.pop("$defs", {}).items():
                doc["components"]["schemas"][dname] = dschema
            doc["components"]["schemas"][name] = schema
            doc["components"]["messages"][name] = {
                "name": name, "contentType": "application/json",
                "payload": {"$ref": f"#/components/schemas/{name}"}}
            refs[name] = {"$ref": f"#/components/messages/{name}"}
        doc["channels"][cid] = {"address": catalogue.absolute(subjects, channel.address),
                                "description": channel.description, "messages": refs}
        doc["operations"][f"ledger_{channel.action}_{cid}"] = {
            "action": channel.action, "channel": {"$ref": f"#/channels/{cid}"}}
    return doc


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
