"""Operator actions: approve, reject and cancel an operation; read its recovery assessment;
retry it (with a review when one is needed) or use a prepared retry plan; the review queue and
reviews. Each action is journaled with the operator's name from the token (`operator_name`
refuses an agent, and a body naming another operator)."""

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from effectledger_core.recovery import Review
from effectledger_core.views import (
    Admission,
    OperationRecord,
    OperationView,
    RecoveryView,
    ReviewQueue,
)

from ..auth import operator_name
from ..db import recovery as rec
from ..openapi import errors
from .bodies import ApproveBody, CancelBody, RejectBody, RetryBody, ReviewBody
from .deps import Call
from .errors import error_response
from .operations import visible

router = APIRouter()


@router.post("/v1/operations/{operation_id}/approve",
             responses={200: {"model": OperationView}, **errors(401, 403, 404, 409, 422)})
async def approve(operation_id: str, body: ApproveBody, c: Call) -> OperationView:
    p, service = c.principal, c.service
    await service.approve(operation_id, epoch=body.epoch,
                          arguments_digest=body.arguments_digest,
                          operator=operator_name(p, body.operator))
    return await service.operation(operation_id)


@router.post("/v1/operations/{operation_id}/reject",
             responses={200: {"model": OperationView}, **errors(401, 403, 404, 409, 422)})
async def reject(operation_id: str, body: RejectBody, c: Call) -> OperationView:
    p, service = c.principal, c.service
    await service.reject(operation_id, epoch=body.epoch,
                         operator=operator_name(p, body.operator), reason=body.reason)
    return await service.operation(operation_id)


@router.post("/v1/operations/{operation_id}/cancel",
             responses={200: {"model": OperationView}, **errors(401, 403, 404, 409, 422)})
async def cancel(operation_id: str, body: CancelBody, c: Call) -> OperationView:
    p, service = c.principal, c.service
    await service.cancel(operation_id, operator=operator_name(p, body.operator),
                         reason=body.reason)
    return await service.operation(operation_id)


@router.get("/v1/operations/{operation_id}/recovery",
            responses={200: {"model": RecoveryView}, **errors(401, 404)})
async def recovery(operation_id: str, c: Call) -> RecoveryView:
    p, service = c.principal, c.service
    await visible(service, p, operation_id)
    a = await service.inspect(operation_id)
    return RecoveryView(fact=a.fact.value, decision=a.decision.value, reason=a.reason)


@router.post("/v1/operations/{operation_id}/retry",
             responses={200: {"model": Admission}, **errors(401, 403, 404, 409, 422)})
async def retry(operation_id: str, body: RetryBody, c: Call) -> JSONResponse:
    p, service = c.principal, c.service
    who = operator_name(p, body.operator)
    review = None
    if body.review is not None:
        op = await service.operation(operation_id)
        epoch = body.review.epoch or body.epoch or op.epoch
        review = Review(operator=operator_name(p, body.review.operator or who),
                        evidence_ref=body.review.evidence_ref,
                        conclusion=body.review.conclusion, epoch=epoch)
    plan_id, admission = await service.retry(operation_id, operator=who, review=review,
                                             for_epoch=body.epoch)
    return _admission(plan_id, admission)


@router.post("/v1/retry-plans/{plan_id}/use",
             summary="Use a prepared single-use retry plan (operator)",
             responses={200: {"model": Admission}, **errors(401, 403, 404, 409)})
async def use_plan(plan_id: str, c: Call) -> JSONResponse:
    p = c.principal
    operator_name(p, None if p.role == "operator" else "anonymous")
    return _admission(plan_id, await c.service.use_plan(plan_id))


@router.get("/v1/reviews", responses={200: {"model": ReviewQueue}, **errors(401, 403, 422)})
async def review_queue(c: Call, limit: int = Query(100, ge=1, le=1000)) -> ReviewQueue:
    p = c.principal
    operator_name(p, None if p.role == "operator" else "anonymous")
    return ReviewQueue(items=await c.service.review_queue(limit))


@router.post("/v1/operations/{operation_id}/reviews",
             responses={200: {"model": OperationView}, **errors(401, 403, 404, 409, 422)})
async def review(operation_id: str, body: ReviewBody, c: Call) -> OperationView:
    p, service = c.principal, c.service
    who = operator_name(p, body.operator)
    op = await service.operation(operation_id)
    await service.review(operation_id, Review(
        operator=who, evidence_ref=body.evidence_ref, conclusion=body.conclusion,
        epoch=body.epoch if body.epoch is not None else op.epoch))
    return await service.operation(operation_id)


def _admission(plan_id: str, admission: rec.Admission) -> JSONResponse:
    if not admission.admitted or admission.operation is None:
        return error_response(409, "retry_refused", f"the retry plan was refused at admission: "
                              f"{admission.reason}",
                              {"reason": admission.reason, "plan_id": plan_id})
    view = Admission(plan_id=plan_id, admitted=True,
                     operation=OperationRecord.model_validate(admission.operation.as_dict()))
    # A JSONResponse like the refusal's, so both answers are written the same way.
    return JSONResponse(view.model_dump(mode="json"))
