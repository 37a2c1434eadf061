"""Does a command name the operation the ledger holds? One comparison for every service.

A dispatch or reconcile command travels over the bus, so a forger (or a bug) could pair one
operation's id and epoch with another tool or other arguments. The ledger checks every claim
against its own row, the dispatcher checks the claim reply against the arguments it is about to
send, and the reconciler checks its command against the ledger's view before a readback: all
with `mismatch`, so the three cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from .digest import digest


def arguments_digest(arguments: Any) -> str:
    """The digest the ledger stores for these arguments (as `intents.validate_arguments`)."""
    return digest(arguments)


def mismatch(*, ledger_tool: str, ledger_digest: str | None, tool: str,
             digest_: str | None) -> str | None:
    """Why a command's tool or arguments digest differs from the ledger's, or None.

    A `None` digest on either side is "not stated" and compared only by tool; the callers decide
    whether an unstated digest is acceptable (the ledger's sender-bound claim subject refuses it).
    """
    if tool != ledger_tool:
        return f"the command names tool {tool!r}; the operation is for {ledger_tool!r}"
    if digest_ is not None and ledger_digest is not None and digest_ != ledger_digest:
        return (f"the command's arguments digest {digest_[:80]!r} differs from the operation's "
                f"{ledger_digest[:80]!r}")
    return None
