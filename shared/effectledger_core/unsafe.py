"""Unsafe switches: the registered ways to turn one of the project's guarantees off.

They exist so the proving ground can show that its checker catches what the guard prevents
(`effectledger chaos --unsafe-skip-claim` must report duplicate provider requests). Like the
crash points in `crash.py`, each is named and listed here, and nowhere else: a service asks
`armed(SWITCH, env)`; `announce` logs the loud warning; `describe` is what
`effectledger unsafe-switches` prints. A new switch is one more `UnsafeSwitch` in `SWITCHES`.

Pure apart from logging: the caller passes the environment mapping (`os.environ` in a service,
a dict in a test). A value that is neither on nor off is an error, so a typo never leaves an
operator unsure whether a guard is off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "EFFECTLEDGER_UNSAFE_"
ON = frozenset({"1", "true", "yes", "on"})
OFF = frozenset({"", "0", "false", "no", "off"})


@dataclass(frozen=True)
class UnsafeSwitch:
    env: str  # the environment variable that arms it
    service: str  # the process that reads it
    disables: str  # the guarantee that is gone while it is armed

    def __post_init__(self) -> None:
        if not self.env.startswith(PREFIX):
            raise ValueError(f"unsafe switch {self.env!r} must be named {PREFIX}*")


SKIP_CLAIM = UnsafeSwitch(
    env=PREFIX + "SKIP_CLAIM",
    service="dispatcher",
    disables="claim-before-call: a redelivered dispatch command whose attempt is already "
              "claimed calls the provider again (duplicate effects)")
SKIP_WEBHOOK_VERIFICATION = UnsafeSwitch(
    env=PREFIX + "SKIP_WEBHOOK_VERIFICATION",
    service="reconciler",
    disables="webhook signature and timestamp verification: anyone can forge provider "
              "evidence and move operations")

NO_SEND_DEADLINE = UnsafeSwitch(
    env=PREFIX + "NO_SEND_DEADLINE",
    service="dispatcher",
    disables="the send deadline: a dispatcher paused between its claim and its send still "
              "sends after the provider's horizon, when the reconciler may have decided "
              "not_applied and a new epoch applied the effect (duplicates on providers that "
              "do not check the fencing token)")

NATS_WITHOUT_PERMISSIONS = UnsafeSwitch(
    env=PREFIX + "NATS_WITHOUT_PERMISSIONS",
    service="up / proving ground",
    disables="NATS users and subject permissions: the broker runs open, so anyone who can "
              "connect may publish outcomes, verdicts, webhooks and dispatch commands, and "
              "submit or read for any tenant")

OPEN_API = UnsafeSwitch(
    env=PREFIX + "OPEN_API",
    service="up (--unsafe-open-api)",
    disables="the ledger's HTTP API tokens: anyone who reaches the ledger's port may submit "
              "for any tenant, read every operation and approve, cancel or retry as anyone")

OPEN_MCP_HTTP = UnsafeSwitch(
    env=PREFIX + "OPEN_MCP_HTTP",
    service="mcp --http (--unsafe-open-http)",
    disables="the MCP HTTP endpoint's tokens in front of an open ledger: any local process "
              "may call the catalog's tools through it")

SWITCHES: tuple[UnsafeSwitch, ...] = (SKIP_CLAIM, SKIP_WEBHOOK_VERIFICATION,
                                      NATS_WITHOUT_PERMISSIONS, NO_SEND_DEADLINE, OPEN_API,
                                      OPEN_MCP_HTTP)
BY_ENV: Mapping[str, UnsafeSwitch] = {s.env: s for s in SWITCHES}


def armed(switch: UnsafeSwitch, env: Mapping[str, str]) -> bool:
    """Whether `switch` is armed in `env`; ValueError for a value that is neither on nor off."""
    if switch not in SWITCHES:
        raise ValueError(f"{switch.env} is not a registered unsafe switch")
    value = env.get(switch.env, "").strip().lower()
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{switch.env}={env[switch.env][:40]!r}: expected one of "
                     f"{sorted(ON)} to arm it or {sorted(OFF - {''})} (or unset) to leave it off")


def armed_switches(env: Mapping[str, str]) -> list[UnsafeSwitch]:
    return [s for s in SWITCHES if armed(s, env)]


def unknown(env: Mapping[str, str]) -> list[str]:
    """`EFFECTLEDGER_UNSAFE_*` names set in `env` that no switch reads (a typo arms nothing)."""
    return sorted(name for name in env if name.startswith(PREFIX) and name not in BY_ENV)


def warning(switch: UnsafeSwitch) -> str:
    return (f"UNSAFE: {switch.env} is set, which turns off {switch.disables}. This switch "
            "exists for the proving ground only and must never be set in production.")


def announce(switch: UnsafeSwitch, log: logging.Logger) -> None:
    """The loud warning a service logs when it starts with `switch` armed."""
    log.critical(warning(switch))


def check(switch: UnsafeSwitch, env: Mapping[str, str], log: logging.Logger) -> bool:
    """`armed(switch, env)`, announcing it on `log` when it is."""
    on = armed(switch, env)
    if on:
        announce(switch, log)
    return on


def describe(env: Mapping[str, str]) -> str:
    """The listing: every switch, the guarantee it turns off, and whether `env` arms it."""
    lines = ["Unsafe switches (test only; each turns a guarantee off):", ""]
    for s in SWITCHES:
        try:
            state = "ARMED" if armed(s, env) else "off"
        except ValueError as exc:
            state = f"INVALID ({exc})"
        lines.append(f"  {s.env}  [{s.service}]  {state}")
        lines.append(f"      turns off {s.disables}")
    stray = unknown(env)
    if stray:
        lines += ["", "Set but not a known switch (no effect): " + ", ".join(stray)]
    return "\n".join(lines)
