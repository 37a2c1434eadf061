"""Validation of intent arguments: size-bounded, depth-bounded, finite JSON."""

from __future__ import annotations

from typing import Any

from .digest import canonical_json, sha256_hex
from .errors import InvalidArguments, PayloadTooLarge
from .limits import MAX_ARGUMENTS_BYTES, MAX_JSON_DEPTH


def _depth(value: Any, limit: int) -> int:
    # Iterative so a hostile, deeply nested document cannot exhaust the stack. Only containers
    # count as a level: `{"a": 1}` nests one level deep, exactly like `{"a": {}}`.
    deepest, stack = 0, [(value, 1)]
    while stack:
        cur, d = stack.pop()
        if not isinstance(cur, dict | list | tuple):  # what json.dumps walks into
            continue
        if d > limit:
            return d
        deepest = max(deepest, d)
        stack.extend((v, d + 1) for v in (cur.values() if isinstance(cur, dict) else cur))
    return deepest


def reject_nul(arguments: Any) -> None:
    """Refuse U+0000 in any key or string: the ledger's PostgreSQL jsonb cannot store it (SQLite
    can), so both backends refuse it with a clear error rather than fail in the database."""
    if _has_nul(arguments):
        raise InvalidArguments("arguments contain a NUL character (U+0000) or an unpaired "
                               "surrogate (not valid Unicode)")


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _has_nul(value: Any) -> bool:
    stack = [value]
    while stack:
        cur = stack.pop()
        if isinstance(cur, str):
            if "\x00" in cur or not _encodable(cur):
                return True
        elif isinstance(cur, dict):
            stack.extend(cur.keys())
            stack.extend(cur.values())
        elif isinstance(cur, list | tuple):
            stack.extend(cur)
    return False


def validate_arguments(arguments: Any) -> tuple[str, str]:
    """Return (canonical JSON, `sha256:` digest) of valid arguments, or raise a clear error."""
    if not isinstance(arguments, dict):
        raise InvalidArguments("arguments must be a JSON object")
    if _depth(arguments, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InvalidArguments(f"arguments nest deeper than {MAX_JSON_DEPTH} levels")
    try:
        text = canonical_json(arguments)
    except (ValueError, TypeError) as exc:
        raise InvalidArguments(f"arguments are not plain JSON: {exc}") from exc
    size = len(text.encode())
    if size > MAX_ARGUMENTS_BYTES:
        raise PayloadTooLarge(f"arguments are {size} bytes; the limit is {MAX_ARGUMENTS_BYTES}",
                              limit=MAX_ARGUMENTS_BYTES)
    return text, "sha256:" + sha256_hex(text)
