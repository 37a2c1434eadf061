"""Ids are UUIDv7 (effectledger_core/ids.py): time-ordered, unique, 32 hex digits."""

from __future__ import annotations

import time
import uuid

from effectledger_core.ids import id_unix_ms, new_id


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


def test_the_time_an_id_was_made_is_read_back_and_only_from_our_ids() -> None:
    before = time.time_ns() // 1_000_000
    made = id_unix_ms(new_id())
    assert made is not None and before <= made <= time.time_ns() // 1_000_000
    assert id_unix_ms("id00001") is None  # a test's counted id
    assert id_unix_ms("0" * 32) is None  # not version 7
    assert id_unix_ms("zzzzzzzzzzzz7" + "0" * 19) is None  # not hex
