"""What every route depends on, as FastAPI dependencies: for an authenticated route one
`Caller` (the principal behind the request's token, the ledger service, the longest wait);
for the health routes the `ApiState`.

`create_app` puts one `ApiState` on `app.state`; the dependencies read it from there. A test
replaces one with `app.dependency_overrides[deps.caller] = ...` (an async function: see
below).
"""

# FastAPI reads these annotations at run time to build the dependency graph: the aliases
# below are module-level so every router resolves them (a local alias, as when the routes were
# closures in create_app, silently became a required query parameter instead).
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.security import HTTPBearer

from effectledger_core.waiting import DEFAULT_MAX_WAIT_S

from ..auth import Authenticator, Principal
from ..openapi import WAIT_DOC
from ..service import LedgerService


@dataclass(frozen=True)
class ApiState:
    service: LedgerService
    authenticator: Authenticator
    ready: Callable[[], Awaitable[dict[str, Any]]]
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    before_scrape: Callable[[], Awaitable[None]] | None = None  # refreshes database gauges


def _state(request: Request) -> ApiState:
    state: ApiState = request.app.state.effectledger_api
    return state


# Every dependency is `async def`, though none awaits anything: FastAPI runs a plain `def`
# dependency in its thread pool, a hand-off to a worker thread and back for each one of each
# request, on the path every agent's call waits on (tests/unit/test_api_routers.py keeps it).
async def api_state(request: Request) -> ApiState:
    return _state(request)


@dataclass(frozen=True)
class Caller:
    """What an authenticated route works with: who is asking (from the request's token), the
    ledger service, and the longest wait a request may ask for (EFFECTLEDGER_WAIT_MAX_S)."""

    principal: Principal
    service: LedgerService
    max_wait_s: float


# One dependency, not three (principal, service, wait cap): FastAPI resolves each dependency
# of each request anew, about 0.07 million instructions apiece (a route's own path, query,
# header and cookie parameters are gathered for every dependency, even when it has none).
async def caller(request: Request) -> Caller:
    state = _state(request)
    return Caller(state.authenticator.authenticate(request), state.service, state.max_wait_s)


# The bearer scheme, for the OpenAPI document only: the Authenticator reads and checks the
# token. openapi.document_bearer declares it on every route that depends on `caller`; as a
# FastAPI `Security` parameter it was one more dependency resolved on every request.
bearer = HTTPBearer(auto_error=False, description="an agent or operator token")

Call = Annotated[Caller, Depends(caller)]
State = Annotated[ApiState, Depends(api_state)]
Wait = Annotated[str | None, Query(description=WAIT_DOC, examples=["10s"])]
ChangedFrom = Annotated[str | None, Query(
    description="with `wait`: also answer as soon as the state is no longer this one "
                "(progress displays)")]
