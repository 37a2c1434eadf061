"""The committed AsyncAPI document is exactly what the message models generate."""

from pathlib import Path

from effectledger_bus.asyncapi import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "asyncapi.json"


def test_committed_asyncapi_matches_the_models() -> None:
    assert DOC.read_text() == render(), (
        "docs/asyncapi.json is stale: python -m effectledger_bus.asyncapi > docs/asyncapi.json")
