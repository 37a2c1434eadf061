"""What the ledger offers and holds: its catalog's tools and its operation counts."""

from fastapi import APIRouter

from effectledger_core.views import Stats, ToolList

from ..openapi import errors
from .deps import Call

router = APIRouter()


@router.get("/v1/tools", responses={200: {"model": ToolList}, **errors(401)})
async def list_tools(c: Call) -> ToolList:
    catalog = c.service.catalog
    tools = catalog.tools
    return ToolList(catalog_digest=catalog.digest(),
                    tools=[tools[n].public_view() for n in sorted(tools)])


# Exclude unset: a tenant's counts have no `outbox` at all (not null).
@router.get("/v1/stats", responses={200: {"model": Stats}, **errors(401)},
            response_model_exclude_unset=True)
async def stats(c: Call) -> Stats:
    # Agents see their own tenant's counts only, like every other read.
    p = c.principal
    return await c.service.stats(tenant=p.tenant if p.role == "agent" else None)
