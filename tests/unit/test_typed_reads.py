"""The ledger's read side is typed end to end: no public method of `LedgerService` and no HTTP
route returns a dict (or `Any`), at any depth of its return annotation. The views of
`effectledger_core.views` (or the typed rows) are what reads answer; a route that picks its
status itself may return a Response built from one."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel

from effectledger_ledger.api.assembly import ROUTERS
from effectledger_ledger.service import LedgerService

# The reads the HTTP API, the console and the NATS handlers answer from: each returns views.
READS = ("operation", "wait_operation", "journal", "receipt", "list_operations", "stats",
         "review_queue")


def _parts(tp: Any) -> Iterator[Any]:
    """`tp` and every type inside it (list[X], X | None, tuple[A, B], ...)."""
    yield tp
    for arg in typing.get_args(tp):
        yield from _parts(arg)


def untyped(fn: Callable[..., Any]) -> list[str]:
    """What in `fn`'s return annotation is a dict or Any (an untyped read)."""
    tp = typing.get_type_hints(fn)["return"]
    return [repr(p) for p in _parts(tp)
            if p is Any or p is dict or typing.get_origin(p) is dict]


def _sample_dict() -> dict[str, Any]:
    return {}


def _sample_nested() -> list[dict[str, int]] | None:
    return None


def test_the_check_itself_finds_a_dict_at_any_depth() -> None:
    assert untyped(_sample_dict) and untyped(_sample_nested)


def _public_methods() -> list[str]:
    return sorted(name for name, fn in inspect.getmembers(LedgerService, inspect.isfunction)
                  if not name.startswith("_"))


@pytest.mark.parametrize("name", _public_methods())
def test_no_public_service_method_returns_a_dict(name: str) -> None:
    assert untyped(getattr(LedgerService, name)) == [], name


@pytest.mark.parametrize("name", READS)
def test_each_read_returns_a_view(name: str) -> None:
    tp = typing.get_type_hints(getattr(LedgerService, name))["return"]
    inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
    assert inspect.isclass(inner) and issubclass(inner, BaseModel), (name, tp)


def _routes() -> list[APIRoute]:
    return [r for router in ROUTERS for r in router.routes if isinstance(r, APIRoute)]


@pytest.mark.parametrize("route", _routes(), ids=lambda r: f"{sorted(r.methods)[0]} {r.path}")
def test_no_route_returns_a_dict(route: APIRoute) -> None:
    assert untyped(route.endpoint) == [], route.path


def test_a_view_writes_the_json_the_api_always_wrote() -> None:
    """Times as Python's isoformat ("+00:00", not pydantic's "Z"), every column in the
    table's order with nulls kept, the undocumented `call_key` before `attempts`."""
    from tests.support.views import AT, operation_view

    view = operation_view(attempts=[{
        "id": "a1", "operation_id": "op1", "epoch": 1, "dispatcher_id": "d1",
        "status": "claimed", "claimed_at": AT}])
    text = view.model_dump_json()
    assert '"created_at":"2026-11-30T09:00:00+00:00"' in text and "Z" not in text
    assert '"finished_at":null' in text and '"evidence":null' in text
    keys = list(view.model_dump())
    assert keys[-3:] == ["result", "call_key", "attempts"], keys
    assert "call_key" not in type(view).model_json_schema()["properties"]
