"""The reconciler's decision vocabulary, shared by its two deciders.

`strategy` decides ambiguous operations and `audit` the duplicate audits; the worker carries
out what either decides. Both speak in the types here, so `strategy` can hand an audit command
to `audit` without the two importing each other. Pure, like both deciders.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from effectledger_bus.backoff import nak_backoff
from effectledger_core.messages import Evidence
from effectledger_core.results import ProviderResult
from effectledger_core.states import State

# A wait ends a little after its boundary, so the redelivery falls on the far side of it.
BOUNDARY_SLACK_S = 0.05
MIN_DELAY_S = 0.05
MAX_REASON = 1024

@dataclass(frozen=True, slots=True)
class Timing:
    """The reconciler's settings that shape decisions."""

    reconcile_deadline_s: float = 3600.0
    webhook_wait_s: float = 300.0
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    # The duplicate audit re-reads this long after the provider's horizon (audit.py).
    audit_slack_s: float = 60.0


@dataclass(frozen=True, slots=True)
class OperationView:
    """The ledger's current view of an operation (the `rpc_operation` reply)."""

    id: str
    state: State
    epoch: int
    operation_key: str | None = None
    tool: str | None = None
    provider_ref: str | None = None
    arguments_digest: str | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """Nothing to do for this command (already decided, superseded): ack it."""

    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Not decidable yet: nak with this delay; the redelivery decides again."""

    delay_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class Decide:
    """Publish this verdict for the command's epoch, then ack."""

    verdict: Literal["applied", "not_applied", "undecidable"]
    reason: str
    evidence: Evidence | None = None
    result: ProviderResult | None = None  # the provider's answer, for `applied` by readback


@dataclass(frozen=True, slots=True)
class Reject:
    """The command can never be processed: dead-letter it (recorded by the ledger), then ack."""

    reason: str


@dataclass(frozen=True, slots=True)
class NeedReadback:
    """Ask the provider once (`tool.readback`), then call `after_readback` with the answer."""


Decision = Done | Wait | Decide | Reject | NeedReadback
AfterReadback = Decide | Wait | Done  # Done: an audit that found nothing to report


def backoff(deliveries: int, timing: Timing) -> float:
    """Exponential backoff from the delivery count (1, 2, 3, ...), capped (the bus's rule)."""
    return nak_backoff(deliveries, base_s=timing.backoff_base_s, cap_s=timing.backoff_cap_s)


def wait_until(boundary: datetime, now: datetime, deliveries: int, timing: Timing,
               reason: str) -> Wait:
    """Back off, but never past the boundary at which the decision changes."""
    left = (boundary - now).total_seconds() + BOUNDARY_SLACK_S
    return Wait(max(MIN_DELAY_S, min(backoff(deliveries, timing), left)), reason)


def bounded(text: str) -> str:
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 1] + "…"
