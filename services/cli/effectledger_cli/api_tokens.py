"""The HTTP API tokens of `effectledger up`: an operator token and an agent token per tenant.

Written beside the NATS credentials (`effectledger_client.localtokens` names the files), mode
0600 in a folder of mode 0700, and kept across restarts of `up` (a token a user copied stays
valid). Only the ledger receives them, in its environment (EFFECTLEDGER_AGENT_TOKENS and
EFFECTLEDGER_OPERATOR_TOKENS); the CLI, the Python client, `effectledger mcp` and the console
sign-in read them from the files.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from effectledger_client import localtokens

from .files import write_private


@dataclass(frozen=True)
class ApiTokens:
    operator_name: str
    operator: str
    agents: dict[str, str]  # tenant -> token
    data: Path

    @property
    def operator_file(self) -> Path:
        return localtokens.operator_file(self.data)

    def agent_file(self, tenant: str) -> Path:
        return localtokens.agent_file(self.data, tenant)

    def ledger_env(self, user: Mapping[str, str] | None = None) -> dict[str, str]:
        """The ledger's settings: who each token is, added to the user's own
        EFFECTLEDGER_AGENT_TOKENS / _OPERATOR_TOKENS (kept, never replaced). ValueError (one
        line) when those are not JSON objects of strings."""
        agents = _tokens(user or {}, "EFFECTLEDGER_AGENT_TOKENS")
        operators = _tokens(user or {}, "EFFECTLEDGER_OPERATOR_TOKENS")
        agents.update({t: n for n, t in self.agents.items()})
        operators[self.operator] = self.operator_name
        return {"EFFECTLEDGER_AGENT_TOKENS": json.dumps(agents),
                "EFFECTLEDGER_OPERATOR_TOKENS": json.dumps(operators)}


def _tokens(env: Mapping[str, str], name: str) -> dict[str, str]:
    text = env.get(name, "").strip()
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in parsed.items()):
        raise ValueError(f'{name} must look like {{"<token>": "<name>"}}')
    return parsed


def operator_name() -> str:
    """The operator `up`'s token stands for (journaled with every action): the local user."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        name = ""
    return re.sub(r"[^A-Za-z0-9_.@-]", "_", name)[:64] or "operator"


def _token(path: Path) -> str:
    """The token in `path` when one is there, else a new one written to it."""
    token = localtokens.read(path)
    if token is None or len(token) < 32:
        token = secrets.token_urlsafe(32)
    write_private(path, token + "\n")  # also re-asserts 0600 on an old file
    return token


def for_up(data: Path, tenants: list[str]) -> ApiTokens:
    folder = data / localtokens.FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return ApiTokens(operator_name=operator_name(),
                     operator=_token(localtokens.operator_file(data)),
                     agents={t: _token(localtokens.agent_file(data, t)) for t in tenants},
                     data=data)
