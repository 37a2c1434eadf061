"""The client finds `effectledger up`'s agent token in the data folder, for a ledger on
loopback only, and an explicit token (argument or EFFECTLEDGER_TOKEN) always wins."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from effectledger_cli import api_tokens
from effectledger_client import AsyncClient, Client, LedgerError, localtokens
from tests.support import rawhttp


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EFFECTLEDGER_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("EFFECTLEDGER_TOKEN", raising=False)
    return tmp_path


def _sent(client: Client) -> str | None:
    value = client._http.headers.get("authorization")
    client.close()
    return value


async def _sent_async(token: str | None) -> str | None:
    """The Authorization header the async client puts on the wire, to a loopback ledger."""
    heads: list[bytes] = []
    server = await rawhttp.answering(heads)
    try:
        async with AsyncClient(rawhttp.url_of(server), token=token) as client:
            with pytest.raises(LedgerError):
                await client.get("x")
    finally:
        server.close()
    return rawhttp.header(heads[0], "Authorization")


def test_up_writes_private_tokens_kept_across_restarts(data: Path) -> None:
    first = api_tokens.for_up(data, ["default", "acme"])
    again = api_tokens.for_up(data, ["default", "acme"])
    assert first == again
    assert first.operator not in first.agents.values()
    for path in (first.operator_file, first.agent_file("default"), first.agent_file("acme")):
        assert path.stat().st_mode & 0o777 == 0o600
    assert (data / "nats-auth").stat().st_mode & 0o777 == 0o700
    env = first.ledger_env()
    assert first.agents["acme"] in env["EFFECTLEDGER_AGENT_TOKENS"]
    assert first.operator in env["EFFECTLEDGER_OPERATOR_TOKENS"]


def test_the_client_sends_the_agent_token_to_a_loopback_ledger_only(
        data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = api_tokens.for_up(data, ["default"])
    agent = f"Bearer {tokens.agents['default']}"
    assert _sent(Client("http://127.0.0.1:8600")) == agent
    assert _sent(Client("http://localhost:9")) == agent
    assert _sent(Client("https://ledger.example.com")) is None  # never off this machine
    assert _sent(Client("http://127.0.0.1:8600", token="mine")) == "Bearer mine"
    assert _sent(Client("http://127.0.0.1:8600", token="")) is None  # explicitly none
    # The async client on the wire: `up`'s token for the loopback ledger (tokens are per
    # data folder, not per port), the caller's when given, none when told none.
    assert asyncio.run(_sent_async(None)) == agent
    assert asyncio.run(_sent_async("mine")) == "Bearer mine"
    assert asyncio.run(_sent_async("")) is None
    monkeypatch.setenv("EFFECTLEDGER_TOKEN", "from-env")
    assert _sent(Client("http://127.0.0.1:8600")) == "Bearer from-env"


def test_a_tenant_that_cannot_name_a_file_finds_nothing(data: Path) -> None:
    assert localtokens.find("http://127.0.0.1:1", tenant="../../etc/passwd") is None
    assert localtokens.find("http://127.0.0.1:1") is None  # no `up` ran here


def test_the_users_own_tokens_are_kept_beside_ups(data: Path) -> None:
    tokens = api_tokens.for_up(data, ["default"])
    env = tokens.ledger_env({"EFFECTLEDGER_AGENT_TOKENS": '{"theirs": "acme"}'})
    assert json.loads(env["EFFECTLEDGER_AGENT_TOKENS"]) == {
        "theirs": "acme", tokens.agents["default"]: "default"}
    with pytest.raises(ValueError, match="EFFECTLEDGER_OPERATOR_TOKENS is not valid JSON"):
        tokens.ledger_env({"EFFECTLEDGER_OPERATOR_TOKENS": "{oops"})
