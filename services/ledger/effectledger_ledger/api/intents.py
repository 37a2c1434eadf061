"""`POST /v1/intents`: an agent (or operator) submits an intent, optionally waiting for it."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from effectledger_core.errors import InvalidRequest, PoisonMessage
from effectledger_core.messages import SubmitIntent, parse
from effectledger_core.views import OperationView
from effectledger_core.waiting import parse_wait

from ..auth import Forbidden
from ..openapi import errors, submit_intent_body
from .bodies import read_bounded
from .deps import Call, Wait

router = APIRouter()


@router.post("/v1/intents", status_code=201, openapi_extra=submit_intent_body(),
             summary="Submit an intent (optionally wait for its outcome)",
             responses={201: {"model": OperationView, "description": "a new operation"},
                        200: {"model": OperationView,
                              "description": "the existing operation for this key and "
                                             "arguments"},
                        **errors(401, 403, 409, 413, 422, 503)})
async def submit_intent(request: Request, c: Call, wait: Wait = None) -> JSONResponse:
    p, service = c.principal, c.service
    wait_s = parse_wait(wait, cap_s=c.max_wait_s)  # a bad wait is refused before submitting
    raw = await read_bounded(request)
    try:
        intent = parse(SubmitIntent, raw)
    except PoisonMessage as exc:
        raise InvalidRequest(exc.message) from exc
    if p.role == "agent":
        if "tenant" in intent.model_fields_set and intent.tenant != p.tenant:
            raise Forbidden("agents submit intents for their own tenant only")
        intent = intent.model_copy(update={"tenant": p.tenant})
    submitted = await service.submit(intent, actor=p.name)
    op_id = submitted.operation["id"]
    created_as = submitted.operation["state"] if submitted.created else None
    view = (await service.wait_operation(op_id, wait_s, created_as=created_as) if wait_s > 0
            else await service.operation(op_id))
    # A JSONResponse, for the status only the submission knows: the view's JSON form.
    return JSONResponse(view.model_dump(mode="json"),
                        status_code=201 if submitted.created else 200)
