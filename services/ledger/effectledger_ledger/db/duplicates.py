"""`duplicate_detected`: the provider shows more than one effect for one operation key.

A readback that counts matches (`readback.count_path`) can see what no response could: the
provider applied one decision twice (it broke its declared horizon, or ignored the key). The
ledger never treats that as a quiet "applied". It is recorded in the journal (kind
`duplicate_detected`), the operation's evidence (so the receipt lists it among the open
uncertainties) and the review queue, and announced to `observers` after the commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from .common import append_journal

log = logging.getLogger(__name__)
KIND = "duplicate_detected"

# Called once per recorded duplicate, after its transaction committed, with the tool name and
# the number of effects seen. The metrics layer registers its counter here.
observers: list[Callable[[str, int], None]] = []


def matches_of(evidence: dict[str, Any] | None) -> int:
    value = (evidence or {}).get("matches")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def is_duplicate(evidence: dict[str, Any] | None) -> bool:
    return matches_of(evidence) > 1


async def note_duplicate_txn(conn: AsyncConnection, *, op: dict[str, Any], epoch: int,
                             evidence: dict[str, Any], actor: str, now: datetime) -> None:
    await append_journal(conn, operation_id=op["id"], at=now, kind=KIND, actor=actor,
                         epoch=epoch, detail={
                             "matches": matches_of(evidence), "tool": op["tool"],
                             "operation_key": op["operation_key"],
                             "provider_ref": evidence.get("provider_ref"),
                             "digest": evidence.get("digest"),
                             "source": evidence.get("source")})


def announce(tool: str, matches: int, operation_id: str) -> None:
    """After the commit: log it loudly and tell every registered observer."""
    log.warning("duplicate_detected: operation %s (tool %s): the provider shows %d effects "
                "for one operation key", operation_id, tool, matches)
    for observer in observers:
        try:
            observer(tool, matches)
        except Exception:  # an observer's bug must not undo a committed record
            log.exception("duplicate_detected observer failed")
