"""The ledger's HTTP API (FastAPI). Errors are JSON: `{"error": {"code", "message"}}`.

Agents (agent tokens) submit intents and read their own tenant's operations; operators
(operator tokens) also approve, reject, cancel, retry and review. Operator actions are journaled
with the operator's name from the token.

One module-level router per group of routes, each route a named function that takes its
caller (the principal, the service and the wait cap: one FastAPI dependency, `deps.py`), so a
route can be found by name and tested alone with `app.dependency_overrides[deps.caller]`;
`create_app` only assembles them.
"""

from .assembly import create_app
from .bodies import read_bounded
from .health import INTENTS_NEED, RELAY_NEEDS

__all__ = ["INTENTS_NEED", "RELAY_NEEDS", "create_app", "read_bounded"]
