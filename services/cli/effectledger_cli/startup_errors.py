"""One clear line, instead of a traceback, for the configuration errors a service meets at start.

A bad setting, a log level that does not exist, a database URL that cannot be parsed or names
no installed driver, and a database that stayed unreachable for the whole start-up wait are
the operator's to fix; a traceback hides the one line that says what to change. Anything not
recognised here is a bug and keeps its traceback.
"""

from __future__ import annotations

import re

import pydantic
import pydantic_settings
import sqlalchemy.exc
from pydantic_core import ErrorDetails


def startup_error_line(exc: BaseException) -> str | None:
    """The line to print for `exc`, or None when it is not a configuration error."""
    if isinstance(exc, pydantic.ValidationError) and exc.title == "Settings":
        return "; ".join(_setting_problem(err) for err in exc.errors())
    if isinstance(exc, pydantic_settings.SettingsError):  # e.g. a JSON setting that is not
        field = re.search(r'field "(\w+)"', str(exc))
        name = f"EFFECTLEDGER_{field.group(1).upper()}" if field else "a setting"
        cause = f": {_first_line(exc.__cause__)}" if exc.__cause__ else ""
        return f"invalid setting {name}: cannot parse its value{cause}"
    if isinstance(exc, ValueError) and str(exc).startswith("unsupported database"):
        return f"invalid EFFECTLEDGER_DATABASE_URL: {exc}"  # effectledger_ledger.db.store
    if isinstance(exc, sqlalchemy.exc.ArgumentError | sqlalchemy.exc.NoSuchModuleError):
        return f"invalid EFFECTLEDGER_DATABASE_URL: {_first_line(exc)}"
    if isinstance(exc, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError
                  | ConnectionError | TimeoutError):
        return (f"the database is not reachable: {_first_line(exc)} "
                "(check EFFECTLEDGER_DATABASE_URL; a starting ledger waits "
                "EFFECTLEDGER_DB_STARTUP_WAIT_S for it)")
    if isinstance(exc, OSError) and exc.__class__.__name__ == "gaierror":
        return f"the database host is unknown: {exc} (check EFFECTLEDGER_DATABASE_URL)"
    return None


def _setting_problem(err: ErrorDetails) -> str:
    name = "_".join(str(part) for part in err["loc"]).upper()
    value = err.get("input")
    shown = "" if isinstance(value, dict) or value is None else f" (got {str(value)[:80]!r})"
    return f"invalid setting EFFECTLEDGER_{name}: {err['msg']}{shown}"


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc) or type(exc).__name__
    return text.strip().splitlines()[0][:300]
