"""Identities and time, injected so tests and simulations are deterministic.

Which id is stable across what: docs/design.md, "Identities".
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from .digest import canonical_json, sha256_hex

IdFactory = Callable[[], str]
Clock = Callable[[], datetime]


def new_id() -> str:
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(UTC)


def operation_key(*, tenant: str, task_id: str | None, caller_key: str | None,
                  operation_id: str) -> str:
    """The stable key sent to providers as `Idempotency-Key` for every attempt and epoch.

    Derived from the caller's key scoped by tenant and task, so two tenants using the same
    caller key never collide at a provider; without a caller key it is tied to the operation.
    """
    if caller_key is None:
        return "op_" + operation_id
    # Canonical JSON, not a separator join: identifiers may contain any character, and
    # ("a\x1fb", "c") must not scope to the same key as ("a", "b\x1fc").
    return "ck_" + sha256_hex(canonical_json([tenant, task_id, caller_key]))[:40]
