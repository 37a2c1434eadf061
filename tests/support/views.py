"""Typed views for fakes: an `OperationView` with every required field filled in, so a fake
service answers what the real one does (the ledger's reads return views, never dicts)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from effectledger_core.views import OperationView

AT = datetime(2026, 11, 30, 9, 0, tzinfo=UTC)


def operation_view(**fields: Any) -> OperationView:
    """An operation as the ledger's service reads it; `fields` override the defaults."""
    values: dict[str, Any] = {
        "id": "op1", "tenant": "default", "operation_key": "ck", "tool": "t", "arguments": {},
        "arguments_digest": "sha256:args", "tool_digest": "sha256:tool",
        "contract_revision": "r1", "effect_class": "idempotent", "commit_policy": "auto",
        "state": "pending", "epoch": 1, "created_at": AT, "updated_at": AT}
    return OperationView.model_validate({**values, **fields})
