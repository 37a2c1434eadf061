"""What every route depends on, as FastAPI dependencies: the ledger service, the principal
behind the request's token, and the ledger's settings for waits and probes.

`create_app` puts one `ApiState` on `app.state`; the dependencies read it from there. A test
replaces any of them with `app.dependency_overrides[deps.service] = ...` (an async function:
see below).
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


async def service(request: Request) -> LedgerService:
    return _state(request).service


async def wait_cap(request: Request) -> float:
    """The longest wait a request may ask for (EFFECTLEDGER_WAIT_MAX_S)."""
    return _state(request).max_wait_s


# The bearer scheme, for the OpenAPI document only: the Authenticator reads and checks the
# token. openapi.document_bearer declares it on every route that depends on `principal`; as a
# FastAPI `Security` parameter here it cost two more dependencies on every request (the
# scheme's own header parsing and the authenticator), 30 of the 70 us FastAPI spent resolving a
# submit's dependencies (about 3 % of the ledger's CPU on an agent's call).
bearer = HTTPBearer(auto_error=False, description="an agent or operator token")


async def principal(request: Request) -> Principal:
    return _state(request).authenticator.authenticate(request)


Service = Annotated[LedgerService, Depends(service)]
Who = Annotated[Principal, Depends(principal)]
WaitCap = Annotated[float, Depends(wait_cap)]
State = Annotated[ApiState, Depends(api_state)]
Wait = Annotated[str | None, Query(description=WAIT_DOC, examples=["10s"])]
ChangedFrom = Annotated[str | None, Query(
    description="with `wait`: also answer as soon as the state is no longer this one "
                "(progress displays)")]
