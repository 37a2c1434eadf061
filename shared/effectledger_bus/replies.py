"""Where a responder may answer: only in the requester's own inbox namespace.

NATS does not check a request's reply subject against the requester's permissions: an agent
may send a legal request whose reply subject is the dispatch subject, an events subject or
`$JS.API.STREAM.PURGE.<stream>`, and a responder that may publish there (the ledger publishes
dispatch commands and uses the JetStream API) would write its answer into that stream or API,
a confused deputy. So a responder checks the reply subject before doing any work:

- it must be an inbox subject: `_INBOX.<tokens>` or `_INBOX_<user>.<tokens>` (nats-py's
  `inbox_prefix`), literal tokens only;
- with a broker that has users (the responder itself connects with one), it must be in the
  inbox namespace of a user that may send this request: on a tenant's subject
  (`rpc.v1.tenant.<t>.…`) the agent of that tenant only; on a dispatcher's claim
  or outcome subject (`rpc.v1.claim.<id>`, `rpc.v1.outcome.<id>`) that dispatcher (or the
  shared `dispatcher` user); on the trusted subjects the roles
  that the NATS permissions (`permissions.py`) let publish there. The shared `_INBOX.` prefix,
  which no user may subscribe to there, is refused.

With an open broker (no users) there is no identity to check: any inbox subject is accepted,
and only stream and API subjects are refused.

Pure: `refusal` answers from the two subjects alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from effectledger_core.subjects import Subjects

from .permissions import Role, user_name

# nats-py's inboxes: `<prefix>.<nuid>` and, for requests, `<prefix>.<nuid>.<token>`.
_INBOX = re.compile(r"^_INBOX(?:_(?P<user>[A-Za-z0-9_-]{1,80}))?(?:\.[A-Za-z0-9_-]{1,64}){1,4}$")
NOT_AN_INBOX = "not_an_inbox"
FOREIGN_INBOX = "another_users_inbox"
REASONS = (NOT_AN_INBOX, FOREIGN_INBOX)


def _of_role(user: str, *roles: Role) -> bool:
    """Every user name starts with its role (`permissions.user_name`): `operator`,
    `reconciler-r1`, `dispatcher`, `agent-acme`, ..."""
    return any(user == r.value or user.startswith(f"{r.value}-") for r in roles)


@dataclass(frozen=True)
class ReplyPolicy:
    subjects: Subjects
    # The broker has users, each receiving replies on its own `_INBOX_<user>.` prefix.
    per_user_inboxes: bool

    def refusal(self, subject: str, reply: str) -> str | None:
        """None when `reply` may be answered for a request on `subject`; else the reason
        (one of REASONS)."""
        m = _INBOX.match(reply)
        if m is None:
            return NOT_AN_INBOX
        if not self.per_user_inboxes:
            return None
        user = m.group("user")
        if user is None or not self._may_ask(subject, user):
            return FOREIGN_INBOX
        return None

    def _may_ask(self, subject: str, user: str) -> bool:
        s = self.subjects
        tenant = s.tenant_of(subject)
        if tenant is not None:
            # Only that tenant's agent (operator tools use the trusted subjects): an agent
            # naming the operator's inbox would otherwise have answers written there.
            return user == f"agent-{tenant}"
        # A dispatcher's claim and outcome subjects: that dispatcher's inbox only.
        dispatcher_id = s.rpc_tail(subject, s.rpc_claim) or s.rpc_tail(subject, s.rpc_outcome)
        if dispatcher_id is not None:
            try:
                own = user_name(Role.DISPATCHER, dispatcher_id)
            except ValueError:  # no dispatcher can be named so: nobody may ask there
                return False
            return user in (own, Role.DISPATCHER.value)
        if subject == s.rpc_claim:  # the unbound claim, for trusted tools and old dispatchers
            return _of_role(user, Role.DISPATCHER, Role.OPERATOR)
        if subject == s.rpc_operation:
            return _of_role(user, Role.OPERATOR, Role.RECONCILER)
        # The trusted intents and wait subjects, and anything else: operator tools only.
        return _of_role(user, Role.OPERATOR)
