"""The proving ground: seeded fault injection against real processes (issue 5).

`run_chaos(ChaosConfig(ops=200, seed=1, ci=True))` starts a private nats-server and PostgreSQL,
the ledger, dispatchers, reconcilers and the sandbox provider as processes, injects the seeded
fault schedule, waits for a quiet period and returns the report: the ten invariants (each must be
zero), metrics and the faults injected. `effectledger chaos` is the command-line form.
"""

from __future__ import annotations

from typing import Any

from .config import ChaosConfig, parse_faults, parse_tool_mix

__all__ = ["ChaosConfig", "parse_faults", "parse_tool_mix", "run_chaos"]


def __getattr__(name: str) -> Any:
    # Imported lazily: `effectledger <any command>` builds its parser from this package, and
    # the services must not pay for the harness's imports at every start.
    if name == "run_chaos":
        from .runner import run_chaos

        return run_chaos
    raise AttributeError(name)
