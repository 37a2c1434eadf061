"""Submit-and-wait: which states end a wait, and how a requested wait is read and capped.

A wait ends as soon as the operation is at rest or needs a human: nothing will change without
a new input (an operator's approval or review), so waiting longer would only waste the
caller's time. Pure: the ledger's waiters and every client share these rules.
"""

from __future__ import annotations

import re

from .errors import InvalidRequest
from .states import AT_REST, State

# At rest (succeeded, failed, cancelled, needs_review) or waiting for an operator's approval.
SETTLED: frozenset[State] = AT_REST | {State.AWAITING_APPROVAL}
SETTLED_VALUES: frozenset[str] = frozenset(s.value for s in SETTLED)

DEFAULT_MAX_WAIT_S = 60.0
_WAIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


def is_settled(state: str) -> bool:
    return state in SETTLED_VALUES


def parse_wait(text: str | None, *, cap_s: float = DEFAULT_MAX_WAIT_S) -> float:
    """`"10s"`, `"500ms"`, `"1m"` or plain seconds (`"2.5"`) → seconds, at most `cap_s`.

    A wait longer than the cap is shortened, not refused: the answer says the current state
    and the caller may wait again. Anything unreadable is refused with a clear error.
    """
    if text is None or text == "":
        return 0.0
    match = _WAIT.match(text)
    if match is None:
        raise InvalidRequest(f"wait must be a duration such as '10s', '500ms' or '2.5', "
                             f"not {text[:64]!r}")
    seconds = float(match.group(1)) * _UNIT[match.group(2)]
    return min(seconds, cap_s)


def wait_over(state: str, changed_from: str | None) -> bool:
    """Whether a wait that started at `changed_from` (None: wait for settled only) is over."""
    return is_settled(state) or (changed_from is not None and state != changed_from)
