"""The requests of the client, shared by its sync and async forms: each method builds a
`Call` (what to send and how to read the answer); the two clients only differ in how they
send it. An answer is read from an `Answer` (status, body, Retry-After), whichever HTTP library
fetched it: httpx for the sync client and for an async client given its own `httpx.AsyncClient`,
aiohttp for the async client's default (`_aio`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from effectledger_core.views import (
    Admission,
    Journal,
    OperationPage,
    OperationView,
    Receipt,
    RecoveryView,
    ReviewQueue,
    Stats,
    ToolList,
)

from .errors import error_from

T = TypeVar("T")


@dataclass(frozen=True)
class Submitted:
    """The answer to a submission: the operation and whether this call created it."""

    operation: OperationView
    created: bool


@dataclass(frozen=True)
class Answer:
    """What reading an answer needs of it."""

    status: int
    body: bytes
    retry_after: str | None = None

    @classmethod
    def of(cls, resp: httpx.Response) -> Answer:
        return cls(resp.status_code, resp.content, resp.headers.get("retry-after"))


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    read: Callable[[Answer], T]
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None

    def request(self, http: httpx.Client | httpx.AsyncClient, *, timeout_s: float,
                wait_s: float) -> httpx.Request:
        # A waiting request may take the whole wait: its read timeout grows with it.
        timeout = httpx.Timeout(timeout_s, read=timeout_s + wait_s)
        return http.build_request(self.method, self.path, params=self.params or None,
                                  json=self.json, timeout=timeout)


def _body(answer: Answer) -> Any:
    try:
        body = json.loads(answer.body) if answer.body else None
    except ValueError:  # not JSON, or not text (UnicodeDecodeError is a ValueError)
        body = None
    if answer.status >= 400:
        raise error_from(answer.status, body, answer.body.decode("utf-8", "replace"),
                         answer.retry_after)
    return body


def _model(model: type[T]) -> Callable[[Answer], T]:
    def read(answer: Answer) -> T:
        return model.model_validate(_body(answer))  # type: ignore[attr-defined, no-any-return]
    return read


def _submitted(answer: Answer) -> Submitted:
    return Submitted(OperationView.model_validate(_body(answer)), created=answer.status == 201)


def wait_param(seconds: float | None) -> dict[str, str]:
    return {"wait": f"{seconds:.3f}s"} if seconds and seconds > 0 else {}


def _op(operation_id: str, suffix: str = "") -> str:
    return f"/v1/operations/{quote(operation_id, safe='')}{suffix}"


def submit(tool: str, arguments: dict[str, Any] | None, *, idempotency_key: str | None,
           task_id: str | None, tenant: str | None, wait_s: float | None,
           join_identical: bool = False, repeat: str | None = None) -> Call[Submitted]:
    body: dict[str, Any] = {"tool": tool, "arguments": arguments or {}}
    for name, value in (("idempotency_key", idempotency_key), ("task_id", task_id),
                        ("tenant", tenant), ("repeat", repeat)):
        if value is not None:
            body[name] = value
    if join_identical:
        body["join_identical"] = True
    return Call("POST", "/v1/intents", _submitted, wait_param(wait_s), body)


def get(operation_id: str, *, wait_s: float | None = None,
        changed_from: str | None = None) -> Call[OperationView]:
    params = wait_param(wait_s)
    if changed_from is not None and params:
        params["changed_from"] = changed_from
    return Call("GET", _op(operation_id), _model(OperationView), params)


def receipt(operation_id: str) -> Call[Receipt]:
    return Call("GET", _op(operation_id, "/receipt"), _model(Receipt))


def journal(operation_id: str) -> Call[Journal]:
    return Call("GET", _op(operation_id, "/journal"), _model(Journal))


def recovery(operation_id: str) -> Call[RecoveryView]:
    return Call("GET", _op(operation_id, "/recovery"), _model(RecoveryView))


def list_operations(*, state: str | None, limit: int, cursor: str | None) -> Call[OperationPage]:
    params: dict[str, Any] = {"limit": limit}
    if state:
        params["state"] = state
    if cursor:
        params["cursor"] = cursor
    return Call("GET", "/v1/operations", _model(OperationPage), params)


def action(operation_id: str, verb: str, body: dict[str, Any]) -> Call[OperationView]:
    """approve, reject, cancel, reviews: each answers with the operation as it is then."""
    return Call("POST", _op(operation_id, f"/{verb}"), _model(OperationView), json=body)


def retry(operation_id: str, body: dict[str, Any]) -> Call[Admission]:
    return Call("POST", _op(operation_id, "/retry"), _model(Admission), json=body)


def use_plan(plan_id: str) -> Call[Admission]:
    return Call("POST", f"/v1/retry-plans/{quote(plan_id, safe='')}/use", _model(Admission))


def review_queue(limit: int) -> Call[ReviewQueue]:
    return Call("GET", "/v1/reviews", _model(ReviewQueue), {"limit": limit})


def tools() -> Call[ToolList]:
    return Call("GET", "/v1/tools", _model(ToolList))


def stats() -> Call[Stats]:
    return Call("GET", "/v1/stats", _model(Stats))


def operator_body(operator: str | None, **fields: Any) -> dict[str, Any]:
    body = {k: v for k, v in fields.items() if v is not None}
    if operator is not None:
        body["operator"] = operator
    return body
