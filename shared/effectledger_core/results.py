"""The provider's answer, kept for the agent: bounded, scrubbed, optionally narrowed.

A model can only use what its tool produced if it sees it: the created ticket, the charge. The
dispatcher keeps the response body of a success (and the reconciler the readback's answer)
through `keep_result`:

- JSON is parsed, and the tool's `result_path` (JSONPath, as for readbacks) keeps only the part
  a model needs: one match is the value itself, several are a list, none is "nothing matched".
- Text is kept as text, cut at the limit (`truncated`). A JSON answer is never cut (half a
  document is not JSON): above the limit its value is omitted and the result says why. The
  limit bounds the value as JSON (escapes included), which is what messages and rows carry.
- Bytes that are not UTF-8 are omitted (`binary`).
- Every string is scrubbed like every provider string: values the request carried in its
  headers (credentials) become `[redacted]`, and NUL (which PostgreSQL cannot store) becomes
  U+FFFD.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from .jsonpaths import check_path, find_all

MAX_RESULT_BYTES = 64 * 1024
# The most a tool may keep: an outcome message carrying it stays well within MAX_MESSAGE_BYTES.
MAX_RESULT_BYTES_CAP = 128 * 1024
REDACTED = "[redacted]"
_MIN_SECRET = 4  # shorter header values ("1", "json") would blot out ordinary text


class ProviderResult(BaseModel):
    """What the provider answered, as the ledger keeps it (`result` of an operation)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    kind: Literal["json", "text"]
    value: Any = None
    truncated: bool = False
    omitted: str | None = None  # why there is no value: too_large, binary, no_match
    bytes: int = 0  # size of the body as received


def check_result_path(path: str) -> str:
    """A catalog's `result_path`, or ValueError saying what is wrong with it (the catalog's
    one JSONPath dialect, as for readback paths)."""
    return check_path(path)


def _scrub_text(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text.replace("\x00", "\ufffd")


def _scrub(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        return _scrub_text(value, secrets)
    if isinstance(value, list):
        return [_scrub(v, secrets) for v in value]
    if isinstance(value, dict):
        return {_scrub_text(k, secrets): _scrub(v, secrets) for k, v in value.items()}
    return value


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _is_json(content_type: str | None) -> bool:
    ct = (content_type or "").split(";")[0].strip().lower()
    return ct == "application/json" or ct.endswith("+json")


def keep_result(body: bytes, content_type: str | None, *, limit: int = MAX_RESULT_BYTES,
                path: str | None = None, secrets: Iterable[str] = ()) -> ProviderResult | None:
    """The part of a provider's answer worth keeping; None for an empty body."""
    if not body:
        return None
    hidden = sorted({s for s in secrets if len(s) >= _MIN_SECRET}, key=len, reverse=True)
    size = len(body)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return ProviderResult(kind="text", omitted="binary", bytes=size)
    if _is_json(content_type) or path is not None:
        try:
            value = json.loads(text, parse_constant=_no_constants)
        except (ValueError, RecursionError):
            value = None
        else:
            return _json_result(_scrub(value, hidden), path, limit, size)
    kept = _scrub_text(text, hidden)
    if _encoded(kept) <= limit:
        return ProviderResult(kind="text", value=kept, bytes=size)
    # Cut by whole characters until the JSON-encoded text (what a message and a row carry,
    # escapes included) fits the limit.
    cut = kept.encode()[:limit].decode("utf-8", errors="ignore")
    while cut and (n := _encoded(cut)) > limit:
        cut = cut[:min(len(cut) - 1, len(cut) * limit // n)]
    return ProviderResult(kind="text", value=cut, truncated=True, bytes=size)


def _encoded(value: Any) -> int:
    """The size of `value` in JSON (UTF-8, escapes included): the bound that matters."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def _json_result(value: Any, path: str | None, limit: int, size: int) -> ProviderResult:
    if path is not None:
        matches = find_all(value, path)
        if not matches:
            return ProviderResult(kind="json", omitted="no_match", bytes=size)
        value = matches[0] if len(matches) == 1 else matches
    if _encoded(value) > limit:
        return ProviderResult(kind="json", omitted="too_large", bytes=size)
    return ProviderResult(kind="json", value=value, bytes=size)
