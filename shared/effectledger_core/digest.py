"""Canonical JSON and sha256 digests: the same value always digests the same way."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def digest(value: Any) -> str:
    """`sha256:<hex>` of the canonical JSON form of `value`."""
    return "sha256:" + sha256_hex(canonical_json(value))
