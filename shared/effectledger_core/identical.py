"""Identical calls: when a call without a key joins an earlier operation, and when it runs anew.

An agent's host retries a call after a timeout, a dropped answer or a restart, and it does not
always keep the idempotency key it sent the first time. An intent that asks for it
(`join_identical`) is therefore also known by its *call identity*: the tenant, the task, the
tool, the arguments' digest and the caller's repeat label. The rule (docs/agents.md, "Identical
calls"):

- a call carrying a key the ledger knows is that key's operation, always;
- a call without a key joins the latest operation of the same identity unless that operation is
  known not to have applied (`failed`, `cancelled`), or it succeeded longer ago than the tool's
  `dedupe_window_s`; an operation whose outcome is not known yet (pending, in flight,
  ambiguous, awaiting approval or review) is always joined: running it anew could be exactly
  the duplicate the ledger exists to prevent;
- a deliberate repeat is a new key, or a new repeat label (part of the identity).

The identity is not the operation key: a new operation always gets its own operation key
(which the provider sees), so a provider that cached a refusal under the first key does not
refuse the new operation for it.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from .digest import canonical_json, sha256_hex
from .states import State

# An identical call joins a succeeded operation for this long unless the tool says otherwise:
# long enough for a host's retries and restarts, short enough that the same message sent again
# the next day is a new message.
DEFAULT_DEDUPE_WINDOW_S = 3600.0
# Known not to have applied: an identical call after them is a new attempt at the effect.
NOT_APPLIED: frozenset[str] = frozenset({State.FAILED.value, State.CANCELLED.value})


def call_identity(*, tenant: str, task_id: str | None, tool: str, arguments_digest: str,
                  repeat: str | None) -> str:
    """The call identity stored in `operations.call_key` (unique while it is held)."""
    return "cl_" + sha256_hex(canonical_json(
        [tenant, task_id, tool, arguments_digest, repeat]))[:40]


def joins(*, state: str, created_at: datetime, now: datetime, window_s: float) -> bool:
    """Whether a key-less identical call made at `now` joins this earlier operation."""
    if state in NOT_APPLIED:
        return False
    if state == State.SUCCEEDED.value:
        return now < created_at + timedelta(seconds=window_s)
    return True  # the outcome is not known yet
