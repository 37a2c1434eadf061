"""Pure helpers for the console's pages: ages, JSON, form values, and what an operator may do
with an operation now. No I/O here, so each rule is tested on its own."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from effectledger_core.catalog import Tool
from effectledger_core.errors import InvalidRequest
from effectledger_core.recovery import Assessment, Decision
from effectledger_core.states import Event, State, sources
from effectledger_core.views import OperationView

from ..auth import Principal


def age(seconds: float | None) -> str:
    """A short human age: '45 s', '3 min 5 s', '2 h 10 min', '3 d 4 h'."""
    if seconds is None:
        return "—"
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def pretty(value: Any) -> str:
    if isinstance(value, BaseModel):  # a view (the receipt): its JSON form, as the API's
        value = value.model_dump(mode="json")
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


SUMMARY_KEYS = ("verdict", "type", "reason", "failure_class", "code", "http_status", "status",
                "conclusion", "evidence_ref", "operator", "message")


def summary(detail: Any, limit: int = 200, skip: str = "") -> str:
    """The few fields of a journal detail or an outcome a reader scans for, on one line
    (`skip`: a field the page already shows next to it)."""
    if not isinstance(detail, dict):
        return ""
    parts = [f"{k}: {detail[k]}" for k in SUMMARY_KEYS
             if k != skip and detail.get(k) not in (None, "", [], {})]
    text = " · ".join(parts)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def as_datetime(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


def when(value: Any) -> str:
    """A timestamp as the console shows it: UTC, to the millisecond."""
    dt = as_datetime(value)
    if dt is None:
        return "—"
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def duration_ms(start: Any, end: Any) -> str:
    a, b = as_datetime(start), as_datetime(end)
    if a is None or b is None:
        return "—"
    return f"{(b - a).total_seconds() * 1000:.0f} ms"


def parse_time(value: str | None, field_name: str) -> datetime | None:
    """A form's `datetime-local` value (no zone: the console works in UTC)."""
    if not value:
        return None
    try:
        dt = datetime.fromisoformat(value)
        # A time at the edge of the calendar with an offset has no UTC value (OverflowError).
        return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)
    except (ValueError, OverflowError) as exc:
        raise InvalidRequest(f"{field_name}: not a date and time: {value!r}") from exc


def text_field(value: str | None) -> str | None:
    """A form's text value, stripped; empty means 'not given'."""
    if value is None:
        return None
    value = value.strip()
    return value or None


@dataclass(frozen=True)
class Action:
    kind: str  # approve | review | cancel | retry
    label: str
    why: str


# The states the ledger accepts each action from (the transition table), so a button is shown
# exactly when the action can succeed. A retry out of needs_review goes through the review page.
_CANCELLABLE = sources(Event.CANCEL)
_RETRYABLE = sources(Event.PLAN_ADMITTED) - {State.NEEDS_REVIEW}


def allowed_actions(op: OperationView, assessment: Assessment) -> list[Action]:
    """What an operator may do with `op` now; the ledger re-checks each at submission."""
    state = State(op.state)
    out: list[Action] = []
    if state is State.AWAITING_APPROVAL:
        out.append(Action("approve", "Review the arguments and approve or reject",
                          "the tool's commit policy requires an operator's approval"))
    if state is State.NEEDS_REVIEW:
        out.append(Action("review", "Record a review",
                          "no machine can decide whether the effect happened"))
    if state in _CANCELLABLE:
        out.append(Action("cancel", "Cancel", "no attempt has been claimed for this epoch"))
    if state in _RETRYABLE and assessment.decision is Decision.MAY_PREPARE:
        out.append(Action("retry", "Prepare and submit a retry plan", assessment.reason))
    return out


def can_act(p: Principal) -> bool:
    return p.is_operator


@dataclass(frozen=True)
class RetryPreview:
    """What the dispatcher will send if a retry plan is admitted: the same arguments under the
    same operation key, with the next epoch as the fencing token."""

    method: str
    endpoint: str
    body_encoding: str
    body: Any
    body_is_template: bool
    headers: dict[str, str]
    next_epoch: int


def retry_preview(op: OperationView, tool: Tool) -> RetryPreview:
    headers = {name: "(from the catalog; value withheld)" for name in sorted(tool.headers)}
    if tool.idempotency_header:
        headers[tool.idempotency_header] = op.operation_key
    if tool.fencing_header:
        headers[tool.fencing_header] = str(op.epoch + 1)
    templated = tool.body is not None
    return RetryPreview(method=tool.method, endpoint=tool.endpoint,
                        body_encoding=tool.body_encoding,
                        body=tool.body if templated else op.arguments,
                        body_is_template=templated, headers=headers,
                        next_epoch=op.epoch + 1)
