"""The console's pipeline page: the outbox, consumers and recent dead letters (operators)."""

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from effectledger_core.ids import utcnow

from ..db import console_reads as cr
from .state import ConsoleDep, SessionDep

router = APIRouter()


@router.get("/pipeline", response_class=HTMLResponse)
async def pipeline(request: Request, console: ConsoleDep, session: SessionDep) -> HTMLResponse:
    console.require_operator(session)
    async with console.service.store.transaction() as conn:
        ov = await cr.overview(conn, tenant=None, now=utcnow())
        letters = await cr.recent_dead_letters(conn)
    return console.render(request, "pipeline.html", session, ov=ov, letters=letters,
                          now=utcnow())
