"""Identities and time, injected so tests and simulations are deterministic.

Which id is stable across what: docs/design.md, "Identities".
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import UTC, datetime

from .digest import canonical_json, sha256_hex

IdFactory = Callable[[], str]
Clock = Callable[[], datetime]


def new_id() -> str:
    """A UUIDv7 (RFC 9562) as 32 hex digits: 48 bits of Unix milliseconds, then 74 random bits.

    Time-ordered, so rows written together sit together in every index keyed by an id
    (operations, attempts, outbox, inbox, and the journal's and outbox's `operation_id`): a
    random UUIDv4 scattered each insert over the whole index, dirtying (and after each
    checkpoint, logging in full) a different page per row. 74 random bits keep ids unguessable;
    the ids never carried authority (docs/design.md, "Trust boundaries"; an agent sees only its
    tenant's operations).
    """
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits, 74 of them used
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | (rand >> 68 & 0xFFF) << 64 \
        | 0b10 << 62 | (rand & 0x3FFF_FFFF_FFFF_FFFF)
    return f"{value:032x}"


def id_unix_ms(value: str) -> int | None:
    """The Unix milliseconds a `new_id` was made at; None for any other string (ids made
    elsewhere, such as a test's counted ids, or a forger's)."""
    if len(value) != 32 or value[12] != "7":
        return None
    try:
        return int(value[:12], 16)
    except ValueError:
        return None


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
