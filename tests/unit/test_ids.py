"""Ids are UUIDv7 (effectledger_core/ids.py): time-ordered, unique, 32 hex digits."""

from __future__ import annotations

import time
import uuid

from effectledger_core.ids import new_id


def test_an_id_is_a_uuid7_in_32_hex_digits() -> None:
    value = new_id()
    assert len(value) == 32 and value == value.lower()
    parsed = uuid.UUID(value)
    assert parsed.version == 7
    assert parsed.variant == uuid.RFC_4122
    # The first 48 bits are the Unix time in milliseconds.
    assert abs(int(value[:12], 16) - time.time_ns() // 1_000_000) < 60_000


def test_ids_of_later_milliseconds_sort_after_earlier_ones() -> None:
    earlier = new_id()
    time.sleep(0.002)  # the wall clock past the next millisecond (nothing to wait for)
    later = [new_id() for _ in range(100)]
    assert all(earlier < x for x in later)


def test_ids_are_unique() -> None:
    ids = [new_id() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
