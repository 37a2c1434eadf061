"""Reading a declarative readback answer: found or not, the provider's reference, how many.

Pure: the caller hands over the status, the (bounded) body and the headers. The rules:
- `not_found_status` means not found;
- `found_when.status`: that status means found; `found_when.json_path`: a non-empty value at the
  path means found (missing, null, false, "", [] and {} mean not found), on a 2xx answer;
- `count_path` counts the effects the answer lists for this key (e.g. a search): 0 is not
  found, 1 is found, more than one is a duplicate the caller must report;
- the reference comes from `ref_path` when set, else the top-level `id`, else `X-Request-Id`;
- with `count_path`, every listed effect's reference is kept too (its `id`, or the value itself
  when the path selects references): a duplicate names all of them, so an operator can tell
  what to refund or delete.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .catalog import Readback
from .jsonpaths import find_all, find_first, scalar_text
from .limits import MAX_DUPLICATE_REFS
from .results import ProviderResult


@dataclass(frozen=True, slots=True)
class ReadbackResult:
    """What one readback showed, from the reading of its answer (`read_answer`) through the
    provider call (`effectledger_providers.calls.readback`, an adapter's `readback_found`) to
    the reconciler's decision: one type all the way.

    `found` None means the provider could not tell (error, unexpected answer).
    """

    found: bool | None
    provider_ref: str | None = None
    evidence_digest: str | None = None  # "sha256:..." of every byte of the answer
    http_status: int | None = None
    error: str | None = None
    # How many effects the answer lists for this key (`readback.count_path`); > 1: duplicate.
    matches: int | None = None
    # The readback's answer, kept for the agent when it found the effect (calls.readback).
    result: ProviderResult | None = None
    # The reference of every effect listed for the key (`count_path`), `provider_ref` first.
    provider_refs: tuple[str, ...] = ()


def _json(content: bytes) -> tuple[bool, Any]:
    if not content:
        return False, None
    try:
        return True, json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False, None


def reference(rb: Readback, body: Any, headers: Mapping[str, str]) -> str | None:
    if rb.ref_path is not None:
        return scalar_text(find_first(body, rb.ref_path))
    if isinstance(body, dict):
        ref = scalar_text(body.get("id"))
        if ref is not None:
            return ref
    return headers.get("x-request-id") or None


def _empty(value: Any) -> bool:
    return value is None or value is False or value in ("", [], {})


def read_answer(rb: Readback, status: int, content: bytes,
                headers: Mapping[str, str]) -> ReadbackResult:
    if status == rb.not_found_status:
        return ReadbackResult(False)
    is_json, body = _json(content)
    if rb.found_when.status is not None:
        if status != rb.found_when.status:
            return ReadbackResult(None, error=f"unexpected readback status {status}")
    elif not 200 <= status < 300:
        return ReadbackResult(None, error=f"unexpected readback status {status}")
    needs_json = rb.found_when.json_path is not None or rb.count_path is not None
    if needs_json and not is_json:
        return ReadbackResult(None, error="readback answer is not JSON")
    if rb.found_when.json_path is not None and _empty(find_first(body, rb.found_when.json_path)):
        return ReadbackResult(False)
    matches = None
    if rb.count_path is not None:
        selected = find_all(body, rb.count_path)
        # `$.data[*]` selects each element; `$.data` selects the list itself: count either way.
        if len(selected) == 1 and isinstance(selected[0], list):
            selected = selected[0]
        matches = len(selected)
        if matches == 0:
            return ReadbackResult(False, matches=0)
        ref = reference(rb, body, headers)
        return ReadbackResult(True, ref, matches=matches,
                              provider_refs=listed_references(ref, selected))
    return ReadbackResult(True, reference(rb, body, headers), matches=matches)


def listed_references(first: str | None, selected: list[Any]) -> tuple[str, ...]:
    """The references of the effects a counting readback listed: each one's `id` (or the
    selected value itself), `first` (the answer's reference) leading; distinct, bounded."""
    refs = [first] + [scalar_text(e.get("id")) if isinstance(e, dict) else scalar_text(e)
                      for e in selected]
    return tuple(dict.fromkeys(r for r in refs if r is not None))[:MAX_DUPLICATE_REFS]
