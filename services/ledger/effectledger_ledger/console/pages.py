"""The console's pages: overview, operations, approvals, reviews and the pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.datastructures import FormData

from effectledger_core.errors import InvalidRequest, UnknownTool
from effectledger_core.ids import utcnow
from effectledger_core.limits import MAX_IDENTIFIER_BYTES
from effectledger_core.recovery import Conclusion, RecoveryRefused, Review
from effectledger_core.states import AT_REST, State

from ..auth import check_tenant
from ..db import console_reads as cr
from ..db.reads import build_receipt
from ..db.recovery import ActionRejected
from . import views
from .sessions import PREFIX

if TYPE_CHECKING:
    from .app import Console
    from .sessions import Session

PAGE_SIZE = 50


def register_pages(app: FastAPI, console: Console) -> None:
    service = console.service

    async def visible_op(session: Session, operation_id: str) -> dict[str, Any]:
        op = await service.operation(operation_id)
        check_tenant(session.principal, op["tenant"])
        return op

    # ---- overview ------------------------------------------------------------------------

    async def overview_context(session: Session) -> dict[str, Any]:
        at, ov = await console.overview(console.tenant_of(session.principal))
        return {"ov": ov, "figures_at": at, "states": [s.value for s in State]}

    @app.get("/", response_class=HTMLResponse)
    async def overview(request: Request) -> HTMLResponse:
        session = console.session(request)
        return console.render(request, "overview.html", session,
                              **await overview_context(session))

    @app.get("/overview/cards", response_class=HTMLResponse)
    async def overview_cards(request: Request) -> HTMLResponse:
        session = console.session(request)
        return console.render(request, "_cards.html", session,
                              **await overview_context(session))

    # ---- operations ----------------------------------------------------------------------

    @app.get("/operations", response_class=HTMLResponse)
    async def operations(request: Request) -> HTMLResponse:
        session = console.session(request)
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

    @app.get("/operations/{operation_id}", response_class=HTMLResponse)
    async def operation(request: Request, operation_id: str) -> HTMLResponse:
        session = console.session(request)
        op = await visible_op(session, operation_id)
        journal = await service.journal(operation_id)
        assessment = await service.inspect(operation_id)
        return console.render(
            request, "operation.html", session, op=op, journal=journal,
            receipt=build_receipt(op), assessment=assessment,
            actions=views.allowed_actions(op, assessment), at_rest=State(op["state"]) in AT_REST)

    @app.get("/operations/{operation_id}/state.json")
    async def operation_state(request: Request, operation_id: str) -> JSONResponse:
        session = console.session(request)
        op = await visible_op(session, operation_id)
        return JSONResponse({"state": op["state"], "epoch": op["epoch"]})

    @app.get("/operations/{operation_id}/receipt.json")
    async def receipt(request: Request, operation_id: str) -> JSONResponse:
        session = console.session(request)
        op = await visible_op(session, operation_id)
        return JSONResponse(build_receipt(op), headers={
            "Content-Disposition": f'attachment; filename="receipt-{operation_id}.json"'})

    @app.post("/operations/{operation_id}/cancel")
    async def cancel(request: Request, operation_id: str) -> Response:
        session = console.session(request)
        form = await console.form(request, session)
        p = console.require_operator(session)
        reason = _bounded(form, "reason", required=False)
        await service.cancel(operation_id, operator=console.actor(p), reason=reason or "")
        session.flash.append("Cancelled.")
        return _see(f"/operations/{operation_id}")

    @app.post("/operations/{operation_id}/retry")
    async def retry(request: Request, operation_id: str) -> Response:
        session = console.session(request)
        form = await console.form(request, session)
        p = console.require_operator(session)
        epoch = _int(form, "epoch")
        plan_id, admission = await service.retry(operation_id, operator=console.actor(p),
                                                 for_epoch=epoch)
        session.flash.append(_admission_text(plan_id, admission))
        return _see(f"/operations/{operation_id}")

    # ---- approvals -----------------------------------------------------------------------

    @app.get("/approvals", response_class=HTMLResponse)
    async def approvals(request: Request) -> HTMLResponse:
        session = console.session(request)
        console.require_operator(session)
        f = cr.OperationFilter(states=("awaiting_approval",), oldest_first=True)
        async with service.store.transaction() as conn:
            items, _ = await cr.list_operations(conn, f, limit=200, cursor=None)
        return console.render(request, "approvals.html", session, items=items)

    async def approval_page(request: Request, session: Session, operation_id: str, *,
                            error: str | None = None, status_code: int = 200) -> HTMLResponse:
        op = await service.operation(operation_id)
        try:
            tool = service.catalog.get(op["tool"])
        except UnknownTool:
            tool = None
        return console.render(request, "approval.html", session, status_code=status_code,
                              op=op, tool=tool, error=error)

    @app.get("/approvals/{operation_id}", response_class=HTMLResponse)
    async def approval(request: Request, operation_id: str) -> HTMLResponse:
        session = console.session(request)
        console.require_operator(session)
        return await approval_page(request, session, operation_id)

    async def stale(op: dict[str, Any], form: FormData, *, digest: bool) -> str | None:
        """Why the page the form came from no longer describes the operation, if it doesn't."""
        seen_epoch = _int(form, "epoch")
        if op["state"] != "awaiting_approval":
            return (f"This page is out of date: the operation is now {op['state']} at epoch "
                    f"{op['epoch']}. Nothing was changed.")
        if seen_epoch != op["epoch"]:
            return (f"This page is out of date: it showed epoch {seen_epoch}, the operation "
                    f"is now at epoch {op['epoch']}. Nothing was changed; read the arguments "
                    f"below again before you decide.")
        if digest and _str(form, "arguments_digest") != op["arguments_digest"]:
            return ("This page is out of date: the arguments it showed are not the ones the "
                    "operation now has. Nothing was approved; read the arguments below again.")
        return None

    async def decide(request: Request, operation_id: str, *, approve: bool) -> Response:
        session = console.session(request)
        form = await console.form(request, session)
        p = console.require_operator(session)
        op = await service.operation(operation_id)
        why = await stale(op, form, digest=approve)
        reason = _bounded(form, "reason", required=not approve)
        if why is None:
            try:
                if approve:
                    await service.approve(operation_id, epoch=op["epoch"],
                                          arguments_digest=_str(form, "arguments_digest") or "",
                                          operator=console.actor(p))
                else:
                    await service.reject(operation_id, epoch=op["epoch"],
                                         operator=console.actor(p), reason=reason or "")
            except ActionRejected as exc:  # it changed between our read and the write
                why = f"This page is out of date: {exc.message}. Nothing was changed."
        if why is not None:
            return await approval_page(request, session, operation_id, error=why,
                                       status_code=409)
        session.flash.append("Approved: the dispatch command is queued." if approve
                             else "Rejected: the operation is cancelled.")
        return _see(f"/operations/{operation_id}")

    @app.post("/approvals/{operation_id}/approve")
    async def approve(request: Request, operation_id: str) -> Response:
        return await decide(request, operation_id, approve=True)

    @app.post("/approvals/{operation_id}/reject")
    async def reject(request: Request, operation_id: str) -> Response:
        return await decide(request, operation_id, approve=False)

    # ---- reviews -------------------------------------------------------------------------

    @app.get("/reviews", response_class=HTMLResponse)
    async def reviews(request: Request) -> HTMLResponse:
        session = console.session(request)
        console.require_operator(session)
        queue = await service.review_queue(200)
        return console.render(request, "reviews.html", session, queue=queue)

    async def review_page(request: Request, session: Session, operation_id: str, *,
                          error: str | None = None, status_code: int = 200) -> HTMLResponse:
        op = await service.operation(operation_id)
        async with service.store.transaction() as conn:
            evidence = await cr.evidence(conn, op)
        preview = None
        try:
            preview = views.retry_preview(op, service.catalog.get(op["tool"]))
        except UnknownTool:
            pass
        return console.render(request, "review.html", session, status_code=status_code,
                              op=op, evidence=evidence, preview=preview, error=error,
                              conclusions=[c.value for c in Conclusion])

    @app.get("/reviews/{operation_id}", response_class=HTMLResponse)
    async def review(request: Request, operation_id: str) -> HTMLResponse:
        session = console.session(request)
        console.require_operator(session)
        return await review_page(request, session, operation_id)

    @app.post("/reviews/{operation_id}")
    async def record_review(request: Request, operation_id: str) -> Response:
        session = console.session(request)
        form = await console.form(request, session)
        p = console.require_operator(session)
        op = await service.operation(operation_id)
        try:
            conclusion = Conclusion(_str(form, "conclusion") or "")
        except ValueError:
            return await review_page(request, session, operation_id, status_code=422,
                                     error="Choose a conclusion: completed, not_executed or "
                                           "uncertain.")
        evidence_ref = _bounded(form, "evidence_ref", required=False)
        if evidence_ref is None:
            return await review_page(request, session, operation_id, status_code=422,
                                     error="An evidence reference is required: the ticket, "
                                           "log or statement the conclusion rests on.")
        epoch = _int(form, "epoch")
        if op["state"] != "needs_review" or epoch != op["epoch"]:
            return await review_page(
                request, session, operation_id, status_code=409,
                error=f"This page is out of date: it showed epoch {epoch}; the operation is "
                      f"now {op['state']} at epoch {op['epoch']}. Nothing was recorded.")
        who = console.actor(p)
        try:
            await service.review(operation_id, Review(operator=who, evidence_ref=evidence_ref,
                                                      conclusion=conclusion, epoch=epoch))
        except ActionRejected as exc:
            return await review_page(request, session, operation_id, status_code=409,
                                     error=f"This page is out of date: {exc.message}.")
        session.flash.append(f"Review recorded: {conclusion.value} ({evidence_ref}).")
        if conclusion is Conclusion.NOT_EXECUTED and form.get("retry") == "yes":
            try:
                plan_id, admission = await service.retry(operation_id, operator=who,
                                                         for_epoch=epoch)
                session.flash.append(_admission_text(plan_id, admission))
            except RecoveryRefused as exc:
                session.flash.append(f"No retry: {exc.message}")
        return _see(f"/operations/{operation_id}")

    # ---- pipeline ------------------------------------------------------------------------

    @app.get("/pipeline", response_class=HTMLResponse)
    async def pipeline(request: Request) -> HTMLResponse:
        session = console.session(request)
        console.require_operator(session)
        async with service.store.transaction() as conn:
            ov = await cr.overview(conn, tenant=None, now=utcnow())
            letters = await cr.recent_dead_letters(conn)
        return console.render(request, "pipeline.html", session, ov=ov, letters=letters,
                              now=utcnow())


def _see(path: str) -> RedirectResponse:
    return RedirectResponse(PREFIX + path, 303)


def _str(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


def _int(form: FormData, name: str) -> int:
    value = _str(form, name)
    if value is None or not value.strip().lstrip("-").isdigit():
        raise InvalidRequest(f"field {name!r} must be a whole number")
    return int(value)


def _bounded(form: FormData, name: str, *, required: bool) -> str | None:
    value = views.text_field(_str(form, name))
    if value is None and required:
        raise InvalidRequest(f"field {name!r} is required")
    if value is not None and len(value.encode()) > MAX_IDENTIFIER_BYTES:
        raise InvalidRequest(f"field {name!r} exceeds {MAX_IDENTIFIER_BYTES} bytes")
    return value


def _admission_text(plan_id: str, admission: Any) -> str:
    if admission.admitted:
        return f"Retry plan {plan_id} admitted: a new attempt is queued."
    return f"Retry plan {plan_id} was refused at admission: {admission.reason}."


