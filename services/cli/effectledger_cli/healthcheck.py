"""The image's health check: `python -m effectledger_cli.healthcheck [SERVICE]`.

One HEALTHCHECK serves every service in the image: the service is the one given, else the
container's main command (`effectledger ledger …` as PID 1), and its liveness endpoint is found
from the same `EFFECTLEDGER_*` settings the service reads. Standard library only, so a check
every few seconds costs a few milliseconds, not a full import of the services.

Exit 0: healthy; 1: unhealthy; 0 as well for one-shot commands (migrate, streams) that have no
endpoint.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

SERVICES = ("ledger", "dispatcher", "reconciler", "sandbox")


def endpoint(service: str, env: dict[str, str], argv: list[str]) -> str | None:
    """The liveness URL of `service` run with `argv` under `env`, or None if it has none."""
    def flag(name: str) -> str | None:
        for i, arg in enumerate(argv):
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return None

    if service == "ledger":
        port = flag("--port") or env.get("EFFECTLEDGER_LEDGER_PORT", "8600")
    elif service == "reconciler":
        port = flag("--port") or env.get("EFFECTLEDGER_RECONCILER_PORT", "8800")
    elif service == "dispatcher":
        port = env.get("EFFECTLEDGER_DISPATCHER_HEALTH_PORT", "")
        if not port:
            return None  # no health port configured: nothing to probe
    elif service == "sandbox":
        port = flag("--port") or "8700"
    else:
        return None
    return f"http://127.0.0.1:{port}/healthz"


def main_command(proc: Path = Path("/proc/1/cmdline")) -> list[str]:
    try:
        return [a for a in proc.read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


def service_of(argv: list[str]) -> str | None:
    return next((a for a in argv if a in SERVICES), None)


def main(args: list[str] | None = None, *, cmdline: Path = Path("/proc/1/cmdline")) -> int:
    args = sys.argv[1:] if args is None else args
    argv = main_command(cmdline)
    service = args[0] if args else service_of(argv)
    if service is None:
        return 0
    url = endpoint(service, dict(os.environ), argv)
    if url is None:
        return 0
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:  # a loopback URL built above
            return 0 if resp.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{service}: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
