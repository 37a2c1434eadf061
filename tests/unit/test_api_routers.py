"""Each HTTP router stands alone: mounted on a bare FastAPI app with the service, the
principal and the console's session replaced through `dependency_overrides`, a route is
driven by name without a database, a broker or tokens."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI

from effectledger_core.errors import NotFound
from effectledger_core.views import Journal, JournalEntry, OperationView
from effectledger_ledger.api import deps, errors, operations, operators
from effectledger_ledger.auth import Principal
from effectledger_ledger.console import operations as console_operations
from effectledger_ledger.console import state as console_state
from effectledger_ledger.console.sessions import Session
from tests.support.views import AT, operation_view

AGENT = Principal("agent", "agent:t1", "t1")
OPERATOR = Principal("operator", "alice")


class FakeService:
    """The few LedgerService calls these routes make, over views it keeps; records every
    action."""

    def __init__(self, *ops: OperationView) -> None:
        self.ops = {op.id: op for op in ops}
        self.actions: list[tuple[str, str, dict[str, Any]]] = []

    async def operation(self, operation_id: str) -> OperationView:
        if operation_id not in self.ops:
            raise NotFound(f"operation {operation_id!r} not found")
        return self.ops[operation_id]

    async def journal(self, operation_id: str) -> Journal:
        return Journal(operation_id=operation_id, entries=[JournalEntry(
            id=1, operation_id=operation_id, at=AT, kind="submitted", actor="agent",
            detail={})])

    async def approve(self, operation_id: str, **kw: Any) -> None:
        self.actions.append(("approve", operation_id, kw))
        self.ops[operation_id] = self.ops[operation_id].model_copy(update={"state": "pending"})


def _op(op_id: str, tenant: str, state: str = "awaiting_approval") -> OperationView:
    return operation_view(id=op_id, tenant=tenant, state=state, operation_key=f"k-{op_id}")


def api(fake: FakeService, who: Principal) -> FastAPI:
    app = FastAPI()
    errors.install(app)
    app.include_router(operations.router)
    app.include_router(operators.router)
    app.dependency_overrides[deps.caller] = lambda: _caller(who, fake)
    return app


def _caller(who: Principal, fake: FakeService) -> deps.Caller:
    return deps.Caller(who, fake, 0.0)  # type: ignore[arg-type]  # the fake stands in


@pytest.fixture
async def fake() -> FakeService:
    return FakeService(_op("op-1", "t1"), _op("op-2", "t2"))


@asynccontextmanager
async def _client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://api.test") as c:
        yield c


async def test_get_operation_alone_hides_another_tenants_operation(fake: FakeService) -> None:
    async with _client(api(fake, AGENT)) as c:
        mine = await c.get("/v1/operations/op-1")
        assert mine.status_code == 200 and mine.json()["id"] == "op-1"
        theirs = await c.get("/v1/operations/op-2")
        assert theirs.status_code == 404
        assert theirs.json()["error"] == {"code": "not_found",
                                          "message": "operation 'op-2' not found"}
        journal = await c.get("/v1/operations/op-1/journal")
        assert journal.json() == {"operation_id": "op-1", "entries": [
            {"id": 1, "operation_id": "op-1", "at": "2026-11-30T09:00:00+00:00",
             "kind": "submitted", "epoch": None, "from_state": None, "to_state": None,
             "actor": "agent", "detail": {}}]}


async def test_approve_alone_refuses_an_agent_and_journals_the_tokens_operator(
        fake: FakeService) -> None:
    body = {"epoch": 1, "arguments_digest": "d1"}
    async with _client(api(fake, AGENT)) as c:
        refused = await c.post("/v1/operations/op-1/approve", json=body)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    assert fake.actions == []
    async with _client(api(fake, OPERATOR)) as c:
        done = await c.post("/v1/operations/op-1/approve", json=body)
        assert done.status_code == 200 and done.json()["state"] == "pending"
    assert fake.actions == [("approve", "op-1", {"epoch": 1, "arguments_digest": "d1",
                                                 "operator": "alice"})]


async def test_a_route_function_is_called_by_name(fake: FakeService) -> None:
    view = await operations.get_operation("op-1", _caller(AGENT, fake))
    assert view.id == "op-1"
    with pytest.raises(NotFound):
        await operations.get_operation("op-2", _caller(AGENT, fake))


class FakeConsole:
    def __init__(self, service: FakeService) -> None:
        self.service = service


def _sync_dependencies(app: FastAPI) -> list[str]:
    """Every dependency FastAPI would run in its thread pool (a plain `def`), by route."""
    from fastapi.dependencies.models import Dependant

    def walk(d: Dependant, route: str) -> list[str]:
        found = []
        for sub in d.dependencies:
            call = sub.call
            # A function, or an instance whose __call__ is the dependency (HTTPBearer).
            fn = call if inspect.isfunction(call) else type(call).__call__
            if call is not None and not inspect.iscoroutinefunction(fn):
                found.append(f"{route}: {getattr(call, '__qualname__', call)}")
            found += walk(sub, route)
        return found

    return [f for r in _routes(app.routes) for f in walk(r.dependant, getattr(r, "path", "?"))]


def _routes(routes: Any) -> list[Any]:
    """Every route with a dependant, through included routers and mounts (FastAPI keeps an
    included router as such since 0.16x, older ones copy its routes)."""
    found = []
    for r in routes:
        if hasattr(r, "dependant"):
            found.append(r)
        elif hasattr(r, "original_router"):
            found += _routes(r.original_router.routes)
        elif hasattr(r, "routes"):
            found += _routes(r.routes)
    return found


def test_no_route_of_the_ledger_hands_a_dependency_to_the_thread_pool() -> None:
    """A `def` dependency costs each request a hand-off to a worker thread and back: on the
    submit, three of them. The API's and the console's are all `async def`."""
    from effectledger_ledger.api.assembly import create_app

    async def ready() -> dict[str, Any]:
        return {}

    app = create_app(FakeService(), ready=ready)  # type: ignore[arg-type]
    assert len(_routes(app.routes)) > 20
    assert _sync_dependencies(app) == []

    # The check sees one: a route with a plain `def` dependency.
    sync_app = FastAPI()
    sync_app.get("/x")(_with_a_sync_dependency)
    assert _sync_dependencies(sync_app) == ["/x: _a_sync_dependency"]


def _a_sync_dependency() -> int:
    return 1


async def _with_a_sync_dependency(v: Annotated[int, Depends(_a_sync_dependency)]) -> int:
    return v


async def test_a_console_route_alone_with_its_session_overridden(fake: FakeService) -> None:
    app = FastAPI()
    app.include_router(console_operations.router)
    app.dependency_overrides[console_state.console_state] = lambda: FakeConsole(fake)
    app.dependency_overrides[console_state.current_session] = lambda: Session(
        id="s", principal=AGENT, csrf="c", expires_at=float("inf"))
    async with _client(app) as c:
        resp = await c.get("/operations/op-1/state.json")
        assert resp.json() == {"state": "awaiting_approval", "epoch": 1}
        with pytest.raises(NotFound):  # no console error pages mounted here: it propagates
            await c.get("/operations/op-2/state.json")
