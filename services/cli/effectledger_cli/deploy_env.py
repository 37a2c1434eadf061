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

# The users of infra/nats/permissions.conf (its $NATS_<USER>_PASSWORD references).
NATS_USERS = ("ledger", "dispatcher", "reconciler", "streams", "agent-default", "operator")


def nats_password_variable(user: str) -> str:
    return f"NATS_{user.upper().replace('-', '_')}_PASSWORD"


def _token(prefix: str = "") -> str:
    return prefix + secrets.token_urlsafe(32)


def generate() -> dict[str, str]:
    """Variable name -> value, for every `${VAR}` the compose files reference."""
    agent, operator = _token("agt_"), _token("opr_")
    hook = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    pg_password = _token()
    env = {
        "POSTGRES_PASSWORD": pg_password,
        # The bundled PostgreSQL (compose, the Kubernetes demo); production brings its own.
        "EFFECTLEDGER_DATABASE_URL":
            f"postgresql+asyncpg://effectledger:{pg_password}@postgres:5432/effectledger",
        "EFFECTLEDGER_AGENT_TOKENS": json.dumps({agent: "default"}),
        "EFFECTLEDGER_OPERATOR_TOKENS": json.dumps({operator: "operator"}),
        # For the CLI on the host: `set -a; . infra/.env; set +a` then `effectledger list`.
        "EFFECTLEDGER_TOKEN": operator,
        "EFFECTLEDGER_SANDBOX_API_KEY": _token("sk_sandbox_"),
        "EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET": hook,
        "EFFECTLEDGER_WEBHOOK_SECRETS": json.dumps({"sandbox": [hook]}),
    }
    # Here, not at the top: every `effectledger` process builds this command's arguments,
    # and up_nats brings the NATS permissions' modules.
    from .up_nats import nats_password

    for user in NATS_USERS:  # referenced as $NAME from nats.conf: see nats_password
        env[nats_password_variable(user)] = nats_password()
    return env


def render(env: dict[str, str]) -> str:
    lines = ["# effectledger compose credentials, made by `effectledger deploy-env`.",
             "# Keep this file private (chmod 600); never commit it."]
    # Single quotes: compose takes the value literally (the JSON keeps its double quotes).
    lines += [f"{name}='{value}'" for name, value in env.items()]
    return "\n".join(lines) + "\n"


def k8s_files(env: dict[str, str]) -> dict[str, str]:
    """The Kubernetes overlay's secretGenerator inputs: provider keys apart, so that only the
    pods that call or read back providers receive them."""
    provider = {k: v for k, v in env.items() if k in PROVIDER_KEYS}
    rest = {k: v for k, v in env.items() if k not in PROVIDER_KEYS}
    # kustomize's env files take values as they are: no quotes.
    return {"secrets.env": "".join(f"{k}={v}\n" for k, v in rest.items()),
            "provider-keys.env": "".join(f"{k}={v}\n" for k, v in provider.items())}


PROVIDER_KEYS = ("EFFECTLEDGER_SANDBOX_API_KEY",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--output", "-o", help="write here (mode 0600) instead of standard "
                                              "output (for infra/compose.yaml: infra/.env)")
    where.add_argument("--k8s", metavar="DIR", help="write secrets.env and provider-keys.env "
                       "(mode 0600) into this Kubernetes overlay folder instead")


def _write_private(path: str, text: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        print(f"effectledger deploy-env: {path} exists; its credentials are in use, so it is "
              "never overwritten (move it away to make new ones)", file=sys.stderr)
        return False
    with os.fdopen(fd, "w") as out:  # O_EXCL: never overwrite a deployment's credentials
        out.write(text)
    print(f"wrote {path} (mode 0600)", file=sys.stderr)
    return True


def run(args: argparse.Namespace) -> int:
    env = generate()
    if args.k8s:
        files = k8s_files(env)
        paths = [os.path.join(args.k8s, name) for name in files]
        taken = [p for p in paths if os.path.exists(p)]
        if taken:  # all or nothing: two files from different runs would not match
            print(f"effectledger deploy-env: {taken[0]} exists; its credentials are in use, "
                  "so it is never overwritten (move it away to make new ones)", file=sys.stderr)
            return 2
        ok = all(_write_private(p, text) for p, text in zip(paths, files.values(), strict=True))
        return 0 if ok else 2
    if not args.output:
        sys.stdout.write(render(env))
        return 0
    return 0 if _write_private(args.output, render(env)) else 2
