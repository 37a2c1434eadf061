"""The console's operations: the filtered list, one operation with its journal and receipt,
and the operator's cancel and retry."""

from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from effectledger_core.errors import InvalidRequest
from effectledger_core.states import AT_REST, State
from effectledger_core.views import OperationView

from ..auth import check_tenant
from ..db import console_reads as cr
from ..db.reads import build_receipt
from ..service import LedgerService
from . import views
from .forms import admission_text, bounded, see, whole_number
from .sessions import Session
from .state import ConsoleDep, CsrfForm, SessionDep

PAGE_SIZE = 50

router = APIRouter()


async def visible_op(service: LedgerService, session: Session,
                     operation_id: str) -> OperationView:
    op = await service.operation(operation_id)
    check_tenant(session.principal, op.tenant)
    return op


@router.get("/operations", response_class=HTMLResponse)
async def operations(request: Request, console: ConsoleDep,
                     session: SessionDep) -> HTMLResponse:
    service = console.service
    q = request.query_params
    tenant = console.tenant_of(session.principal)
    order = q.get("order", "newest")
    if order not in ("newest", "oldest"):
        raise InvalidRequest("order is 'newest' or 'oldest'")
    f = cr.OperationFilter(
        states=tuple(s for s in q.getlist("state") if s),
        tool=views.text_field(q.get("tool")),
        tenant=tenant if tenant is not None else views.text_field(q.get("tenant")),
        task=views.text_field(q.get("task")),
        created_from=views.parse_time(q.get("from"), "from"),
        created_to=views.parse_time(q.get("to"), "to"),
        text=views.text_field(q.get("q")),
        duplicates=q.get("duplicates") == "1", oldest_first=order == "oldest")
    async with service.store.transaction() as conn:
        items, next_cursor = await cr.list_operations(conn, f, limit=PAGE_SIZE,
                                                      cursor=q.get("cursor") or None)
        tools = await cr.tools_in_use(conn, tenant=tenant)
    kept = [(k, v) for k, v in q.multi_items() if k != "cursor" and v]
    next_url = (f"?{urlencode([*kept, ('cursor', next_cursor)])}" if next_cursor else None)
    first_url = f"?{urlencode(kept)}" if q.get("cursor") else None
    return console.render(request, "operations.html", session, items=items, f=f,
                          order=order, tools=sorted(set(tools) | set(service.catalog.tools)),
                          states=[s.value for s in State], next_url=next_url,
                          first_url=first_url, q=q)


@router.get("/operations/{operation_id}", response_class=HTMLResponse)
async def operation(request: Request, operation_id: str, console: ConsoleDep,
                    session: SessionDep) -> HTMLResponse:
    service = console.service
    op = await visible_op(service, session, operation_id)
    journal = await service.journal(operation_id)
    assessment = await service.inspect(operation_id)
    return console.render(
        request, "operation.html", session, op=op, journal=journal.entries,
        receipt=build_receipt(op), assessment=assessment,
        actions=views.allowed_actions(op, assessment), at_rest=State(op.state) in AT_REST)


@router.get("/operations/{operation_id}/state.json")
async def operation_state(operation_id: str, console: ConsoleDep,
                          session: SessionDep) -> JSONResponse:
    op = await visible_op(console.service, session, operation_id)
    return JSONResponse({"state": op.state, "epoch": op.epoch})


@router.get("/operations/{operation_id}/receipt.json")
async def receipt(operation_id: str, console: ConsoleDep, session: SessionDep) -> JSONResponse:
    op = await visible_op(console.service, session, operation_id)
    return JSONResponse(build_receipt(op).model_dump(mode="json"), headers={
        "Content-Disposition": f'attachment; filename="receipt-{operation_id}.json"'})


@router.post("/operations/{operation_id}/cancel")
async def cancel(operation_id: str, console: ConsoleDep, session: SessionDep,
                 form: CsrfForm) -> Response:
    p = console.require_operator(session)
    reason = bounded(form, "reason", required=False)
    await console.service.cancel(operation_id, operator=console.actor(p), reason=reason or "")
    session.flash.append("Cancelled.")
    return see(f"/operations/{operation_id}")


@router.post("/operations/{operation_id}/retry")
async def retry(operation_id: str, console: ConsoleDep, session: SessionDep,
                form: CsrfForm) -> Response:
    p = console.require_operator(session)
    epoch = whole_number(form, "epoch")
    plan_id, admission = await console.service.retry(operation_id, operator=console.actor(p),
                                                     for_epoch=epoch)
    session.flash.append(admission_text(plan_id, admission))
    return see(f"/operations/{operation_id}")
