"""`effectledger deploy-env`: fresh credentials for the compose stack, as an `.env` file.

    effectledger deploy-env > infra/.env && chmod 600 infra/.env

Every secret the compose file references is made here, at random, once per deployment: the
PostgreSQL password, one NATS user and password per service, the API's agent and operator
tokens, the sandbox provider's API key and the webhook signing secret shared by the sandbox
(signs) and the reconciler (verifies). Nothing has a default that works, so a stack started
without an `.env` fails at once instead of running with well-known secrets.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import sys

NATS_USERS = ("ledger", "dispatcher", "reconciler", "streams")


def _token(prefix: str = "") -> str:
    return prefix + secrets.token_urlsafe(32)


def generate() -> dict[str, str]:
    """Variable name -> value, for every `${VAR}` the compose files reference."""
    agent, operator = _token("agt_"), _token("opr_")
    hook = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    env = {
        "POSTGRES_PASSWORD": _token(),
        "EFFECTLEDGER_AGENT_TOKENS": json.dumps({agent: "default"}),
        "EFFECTLEDGER_OPERATOR_TOKENS": json.dumps({operator: "operator"}),
        # For the CLI on the host: `set -a; . infra/.env; set +a` then `effectledger list`.
        "EFFECTLEDGER_TOKEN": operator,
        "EFFECTLEDGER_SANDBOX_API_KEY": _token("sk_sandbox_"),
        "EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET": hook,
        "EFFECTLEDGER_WEBHOOK_SECRETS": json.dumps({"sandbox": [hook]}),
    }
    for user in NATS_USERS:
        env[f"NATS_{user.upper()}_PASSWORD"] = _token()
    return env


def render(env: dict[str, str]) -> str:
    lines = ["# effectledger compose credentials, made by `effectledger deploy-env`.",
             "# Keep this file private (chmod 600); never commit it."]
    # Single quotes: compose takes the value literally (the JSON keeps its double quotes).
    lines += [f"{name}='{value}'" for name, value in env.items()]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", "-o", help="write here (mode 0600) instead of standard output")


def run(args: argparse.Namespace) -> int:
    text = render(generate())
    if not args.output:
        sys.stdout.write(text)
        return 0
    try:
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(f"effectledger deploy-env: {args.output} exists; its credentials are in use, "
              "so it is never overwritten (move it away to make new ones)", file=sys.stderr)
        return 2
    with os.fdopen(fd, "w") as out:  # O_EXCL: never overwrite a deployment's credentials
        out.write(text)
    print(f"wrote {args.output} (mode 0600)", file=sys.stderr)
    return 0
