"""Reading the console's posted form fields, and the answers its actions share."""

from typing import Any

from fastapi.responses import RedirectResponse
from starlette.datastructures import FormData

from effectledger_core.errors import InvalidRequest
from effectledger_core.limits import MAX_IDENTIFIER_BYTES

from . import views
from .sessions import PREFIX


def see(path: str) -> RedirectResponse:
    """After a post, the page to see (303: the browser GETs it)."""
    return RedirectResponse(PREFIX + path, 303)


def text(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


def whole_number(form: FormData, name: str) -> int:
    value = (text(form, name) or "").strip()
    # ASCII only: str.isdigit() also accepts digits int() refuses ("\u00b2"), a 500 found by
    # the hostile-bytes test. The numbers asked for are epochs, a 32-bit column.
    if value.isascii() and value.removeprefix("-").isdigit() and len(value) <= 11:
        number = int(value)
        if -(2**31) <= number < 2**31:
            return number
    raise InvalidRequest(f"field {name!r} must be a whole number of 32 bits")


def bounded(form: FormData, name: str, *, required: bool) -> str | None:
    value = views.text_field(text(form, name))
    if value is None and required:
        raise InvalidRequest(f"field {name!r} is required")
    if value is not None and len(value.encode()) > MAX_IDENTIFIER_BYTES:
        raise InvalidRequest(f"field {name!r} exceeds {MAX_IDENTIFIER_BYTES} bytes")
    return value


def admission_text(plan_id: str, admission: Any) -> str:
    if admission.admitted:
        return f"Retry plan {plan_id} admitted: a new attempt is queued."
    return f"Retry plan {plan_id} was refused at admission: {admission.reason}."
