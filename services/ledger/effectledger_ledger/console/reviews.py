"""The console's reviews: the queue, one operation's evidence with a retry preview, and the
operator's recorded conclusion (with an optional retry when it was not executed)."""

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from effectledger_core.errors import UnknownTool
from effectledger_core.recovery import Conclusion, RecoveryRefused, Review
from effectledger_core.states import State

from ..db import console_reads as cr
from ..db.recovery import ActionRejected
from ..db.reviews import review_item
from . import views
from .forms import admission_text, bounded, see, text, whole_number
from .sessions import Session
from .state import Console, ConsoleDep, CsrfForm, SessionDep

router = APIRouter()


@router.get("/reviews", response_class=HTMLResponse)
async def reviews(request: Request, console: ConsoleDep, session: SessionDep) -> HTMLResponse:
    console.require_operator(session)
    queue = await console.service.review_queue(200)
    return console.render(request, "reviews.html", session, queue=queue)


async def review_page(request: Request, console: Console, session: Session,
                      operation_id: str, *, error: str | None = None,
                      status_code: int = 200) -> HTMLResponse:
    service = console.service
    op = await service.operation(operation_id)
    async with service.store.transaction() as conn:
        item = await review_item(conn, op, kinds=cr.REVIEW_PAGE_KINDS)
    preview = None
    try:
        preview = views.retry_preview(op, service.catalog.get(op.tool))
    except UnknownTool:
        pass
    return console.render(request, "review.html", session, status_code=status_code,
                          op=op, item=item, preview=preview, error=error,
                          conclusions=[c.value for c in Conclusion])


@router.get("/reviews/{operation_id}", response_class=HTMLResponse)
async def review(request: Request, operation_id: str, console: ConsoleDep,
                 session: SessionDep) -> HTMLResponse:
    console.require_operator(session)
    return await review_page(request, console, session, operation_id)


@router.post("/reviews/{operation_id}")
async def record_review(request: Request, operation_id: str, console: ConsoleDep,
                        session: SessionDep, form: CsrfForm) -> Response:
    p = console.require_operator(session)
    service = console.service
    op = await service.operation(operation_id)
    try:
        conclusion = Conclusion(text(form, "conclusion") or "")
    except ValueError:
        return await review_page(request, console, session, operation_id, status_code=422,
                                 error="Choose a conclusion: completed, not_executed or "
                                       "uncertain.")
    evidence_ref = bounded(form, "evidence_ref", required=False)
    if evidence_ref is None:
        return await review_page(request, console, session, operation_id, status_code=422,
                                 error="An evidence reference is required: the ticket, "
                                       "log or statement the conclusion rests on.")
    epoch = whole_number(form, "epoch")
    if op.state != State.NEEDS_REVIEW or epoch != op.epoch:
        return await review_page(
            request, console, session, operation_id, status_code=409,
            error=f"This page is out of date: it showed epoch {epoch}; the operation is "
                  f"now {op.state} at epoch {op.epoch}. Nothing was recorded.")
    who = console.actor(p)
    try:
        await service.review(operation_id, Review(operator=who, evidence_ref=evidence_ref,
                                                  conclusion=conclusion, epoch=epoch))
    except ActionRejected as exc:
        return await review_page(request, console, session, operation_id, status_code=409,
                                 error=f"This page is out of date: {exc.message}.")
    session.flash.append(f"Review recorded: {conclusion.value} ({evidence_ref}).")
    if conclusion is Conclusion.NOT_EXECUTED and form.get("retry") == "yes":
        try:
            plan_id, admission = await service.retry(operation_id, operator=who,
                                                     for_epoch=epoch)
            session.flash.append(admission_text(plan_id, admission))
        except RecoveryRefused as exc:
            session.flash.append(f"No retry: {exc.message}")
    return see(f"/operations/{operation_id}")
