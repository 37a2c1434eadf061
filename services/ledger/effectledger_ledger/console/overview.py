"""The console's overview page and its cards, refreshed in the background."""

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from effectledger_core.states import State

from .sessions import Session
from .state import Console, ConsoleDep, SessionDep

router = APIRouter()


async def overview_context(console: Console, session: Session) -> dict[str, Any]:
    at, ov = await console.overview(console.tenant_of(session.principal))
    return {"ov": ov, "figures_at": at, "states": [s.value for s in State]}


@router.get("/", response_class=HTMLResponse)
async def overview(request: Request, console: ConsoleDep, session: SessionDep) -> HTMLResponse:
    return console.render(request, "overview.html", session,
                          **await overview_context(console, session))


@router.get("/overview/cards", response_class=HTMLResponse)
async def overview_cards(request: Request, console: ConsoleDep,
                         session: SessionDep) -> HTMLResponse:
    return console.render(request, "_cards.html", session,
                          **await overview_context(console, session))
