"""Reading operations: one (optionally waiting until it settles), its journal, its receipt,
and pages of them. Agents see their own tenant's only; another tenant's reads as missing."""

from fastapi import APIRouter, Query

from effectledger_core.views import Journal, OperationPage, OperationView, Receipt
from effectledger_core.waiting import parse_wait, wait_over

from ..auth import Principal, check_tenant
from ..openapi import errors
from ..service import LedgerService
from .deps import Call, ChangedFrom, Wait

router = APIRouter()


async def visible(service: LedgerService, p: Principal, operation_id: str) -> OperationView:
    op = await service.operation(operation_id)
    # Another tenant's operation reads exactly like a missing one, message included.
    check_tenant(p, op.tenant, operation_id)
    return op


async def waited(service: LedgerService, op: OperationView, wait: str | None,
                 changed_from: str | None, *, cap_s: float) -> OperationView:
    wait_s = parse_wait(wait, cap_s=cap_s)
    if wait_s <= 0 or wait_over(op.state, changed_from):
        return op  # nothing to wait for: no second read
    return await service.wait_operation(op.id, wait_s, changed_from=changed_from)


@router.get("/v1/operations/{operation_id}", responses={
    200: {"model": OperationView}, **errors(401, 404, 422)},
    summary="An operation (optionally wait until it is settled)")
async def get_operation(operation_id: str, c: Call, wait: Wait = None,
                        changed_from: ChangedFrom = None) -> OperationView:
    return await waited(c.service, await visible(c.service, c.principal, operation_id), wait,
                        changed_from, cap_s=c.max_wait_s)


@router.get("/v1/operations/{operation_id}/journal",
            responses={200: {"model": Journal}, **errors(401, 404)})
async def get_journal(operation_id: str, c: Call) -> Journal:
    await visible(c.service, c.principal, operation_id)
    return await c.service.journal(operation_id)


@router.get("/v1/operations/{operation_id}/receipt",
            responses={200: {"model": Receipt}, **errors(401, 404)})
async def get_receipt(operation_id: str, c: Call) -> Receipt:
    await visible(c.service, c.principal, operation_id)
    return await c.service.receipt(operation_id)


@router.get("/v1/operations", responses={200: {"model": OperationPage}, **errors(401, 422)})
async def list_operations(c: Call, state: str | None = None,
                          limit: int = Query(100, ge=1, le=1000),
                          cursor: str | None = None) -> OperationPage:
    return await c.service.list_operations(state=state, limit=limit, cursor=cursor,
                                           tenant=c.principal.tenant)
