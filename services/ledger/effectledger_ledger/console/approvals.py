"""The console's approvals: the queue, one approval with the tool and its arguments, and the
operator's approve / reject, refused with a clear page when the page it came from is stale."""

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from starlette.datastructures import FormData

from effectledger_core.errors import UnknownTool
from effectledger_core.states import State
from effectledger_core.views import OperationView

from ..db import console_reads as cr
from ..db.recovery import ActionRejected
from .forms import bounded, see, text, whole_number
from .sessions import Session
from .state import Console, ConsoleDep, CsrfForm, SessionDep

router = APIRouter()


@router.get("/approvals", response_class=HTMLResponse)
async def approvals(request: Request, console: ConsoleDep, session: SessionDep) -> HTMLResponse:
    console.require_operator(session)
    f = cr.OperationFilter(states=(State.AWAITING_APPROVAL.value,), oldest_first=True)
    async with console.service.store.transaction() as conn:
        items, _ = await cr.list_operations(conn, f, limit=200, cursor=None)
    return console.render(request, "approvals.html", session, items=items)


async def approval_page(request: Request, console: Console, session: Session,
                        operation_id: str, *, error: str | None = None,
                        status_code: int = 200) -> HTMLResponse:
    op = await console.service.operation(operation_id)
    try:
        tool = console.service.catalog.get(op.tool)
    except UnknownTool:
        tool = None
    return console.render(request, "approval.html", session, status_code=status_code,
                          op=op, tool=tool, error=error)


@router.get("/approvals/{operation_id}", response_class=HTMLResponse)
async def approval(request: Request, operation_id: str, console: ConsoleDep,
                   session: SessionDep) -> HTMLResponse:
    console.require_operator(session)
    return await approval_page(request, console, session, operation_id)


def stale(op: OperationView, form: FormData, *, digest: bool) -> str | None:
    """Why the page the form came from no longer describes the operation, if it doesn't."""
    seen_epoch = whole_number(form, "epoch")
    if op.state != State.AWAITING_APPROVAL:
        return (f"This page is out of date: the operation is now {op.state} at epoch "
                f"{op.epoch}. Nothing was changed.")
    if seen_epoch != op.epoch:
        return (f"This page is out of date: it showed epoch {seen_epoch}, the operation "
                f"is now at epoch {op.epoch}. Nothing was changed; read the arguments "
                f"below again before you decide.")
    if digest and text(form, "arguments_digest") != op.arguments_digest:
        return ("This page is out of date: the arguments it showed are not the ones the "
                "operation now has. Nothing was approved; read the arguments below again.")
    return None


async def decide(request: Request, console: Console, session: Session, form: FormData,
                 operation_id: str, *, approve: bool) -> Response:
    p = console.require_operator(session)
    service = console.service
    op = await service.operation(operation_id)
    why = stale(op, form, digest=approve)
    reason = bounded(form, "reason", required=not approve)
    if why is None:
        try:
            if approve:
                await service.approve(operation_id, epoch=op.epoch,
                                      arguments_digest=text(form, "arguments_digest") or "",
                                      operator=console.actor(p))
            else:
                await service.reject(operation_id, epoch=op.epoch,
                                     operator=console.actor(p), reason=reason or "")
        except ActionRejected as exc:  # it changed between our read and the write
            why = f"This page is out of date: {exc.message}. Nothing was changed."
    if why is not None:
        return await approval_page(request, console, session, operation_id, error=why,
                                   status_code=409)
    session.flash.append("Approved: the dispatch command is queued." if approve
                         else "Rejected: the operation is cancelled.")
    return see(f"/operations/{operation_id}")


@router.post("/approvals/{operation_id}/approve")
async def approve(request: Request, operation_id: str, console: ConsoleDep,
                  session: SessionDep, form: CsrfForm) -> Response:
    return await decide(request, console, session, form, operation_id, approve=True)


@router.post("/approvals/{operation_id}/reject")
async def reject(request: Request, operation_id: str, console: ConsoleDep,
                 session: SessionDep, form: CsrfForm) -> Response:
    return await decide(request, console, session, form, operation_id, approve=False)
