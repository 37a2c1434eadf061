"""`submit`, `show`, `list` and the operator actions, on the typed client (effectledger_client).

Exit codes, so scripts can branch without parsing: 0 succeeded (or, without `--wait`, the
request was accepted), 1 the ledger refused the request (sending it again unchanged is refused
again), 2 bad usage, and with `--wait`: 3 failed or cancelled, 4 outcome unknown (ambiguous,
needs review), 5 awaiting an operator's approval, 6 the wait ended before the operation
settled; 7 the ledger could not be reached, was unavailable or rate limited the request: it is
not known to be recorded, and sending the same command again is safe (a `submit` names the
idempotency key to resend it with).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from pydantic import BaseModel

from effectledger_client import Client, LedgerError, OperationView, RateLimited, localtokens
from effectledger_core.ids import new_id
from effectledger_core.states import State

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_FAILED, EXIT_UNKNOWN, EXIT_APPROVAL, EXIT_TIMEOUT = 3, 4, 5, 6
EXIT_RESEND = 7  # not known to be recorded; the same command again is safe
_BY_STATE: dict[str, int] = {
    State.SUCCEEDED: EXIT_OK, State.FAILED: EXIT_FAILED, State.CANCELLED: EXIT_FAILED,
    State.NEEDS_REVIEW: EXIT_UNKNOWN, State.AMBIGUOUS: EXIT_UNKNOWN,
    State.AWAITING_APPROVAL: EXIT_APPROVAL}


def exit_code(op: OperationView) -> int:
    """What a waited-for operation's state means to a script (see module docstring)."""
    return _BY_STATE.get(op.state, EXIT_TIMEOUT)


def _print(data: BaseModel | Any) -> None:
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    print(json.dumps(data, indent=2, sort_keys=True))


class _Progress:
    """One line per state on a terminal (stderr), so stdout stays the JSON answer."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.last: str | None = None

    def __call__(self, op: OperationView) -> None:
        if op.state != self.last:
            self.last = op.state
            print(f"  {time.monotonic() - self.started:6.2f}s  {op.state}", file=sys.stderr,
                  flush=True)


OPERATOR_COMMANDS = frozenset({"approve", "reject", "cancel", "retry", "review"})


def local_token(args: argparse.Namespace) -> str | None:
    """The token to send when EFFECTLEDGER_TOKEN is not set: the one `effectledger up` made
    for this command (localtokens; a ledger on loopback only). Operator actions use the
    operator's; submissions and reads the tenant's agent token, else the operator's."""
    if os.environ.get("EFFECTLEDGER_TOKEN") is not None:
        return None  # the client sends that one
    url, data = args.ledger_url, getattr(args, "data_dir", None)
    if args.command in OPERATOR_COMMANDS:
        return localtokens.find(url, operator=True, data=data)
    tenant = getattr(args, "tenant", None) or localtokens.DEFAULT_TENANT
    return (localtokens.find(url, tenant=tenant, data=data)
            or localtokens.find(url, operator=True, data=data))


def run(args: argparse.Namespace) -> int:
    # Agents and operators authenticate with a bearer token: EFFECTLEDGER_TOKEN, else the
    # one `effectledger up` wrote into its data folder.
    try:
        with Client(args.ledger_url, token=local_token(args)) as client:
            return _run(client, args)
    except LedgerError as exc:
        print(f"effectledger: {exc.code}: {exc.message}", file=sys.stderr)
        if exc.details:
            print(json.dumps(exc.details, indent=2), file=sys.stderr)
        if exc.retryable:
            after = exc.retry_after_s if isinstance(exc, RateLimited) else None
            key = getattr(args, "sent_key", None)
            print("effectledger: not known to be recorded; sending the same command again is "
                  "safe" + (f" after {after:g} s" if after is not None else "")
                  + (f" with --key {key}" if key else ""), file=sys.stderr)
            return EXIT_RESEND
        return EXIT_ERROR


def _wait(client: Client, op: OperationView, wait_s: float,
          progress: _Progress | None) -> int:
    op = client.wait(op.id, wait_s, on_change=progress, current=op)
    _print(op)
    return exit_code(op)


def _run(client: Client, args: argparse.Namespace) -> int:
    if args.command == "submit":
        try:
            arguments = json.loads(args.args)
        except json.JSONDecodeError as exc:
            print(f"effectledger: --args is not valid JSON: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if not isinstance(arguments, dict):
            print("effectledger: --args must be a JSON object", file=sys.stderr)
            return EXIT_USAGE
        # On a terminal each state is shown as it comes (waits that end at every change);
        # otherwise the submission itself waits, and one request usually answers it all.
        progress = _Progress() if args.wait > 0 and sys.stderr.isatty() else None
        started = time.monotonic()
        # Always under a key, so that a submission whose answer is lost can be sent again
        # safely: the key is named if it must be (exit 7).
        args.sent_key = args.key or "cli-" + new_id()
        submitted = client.submit(args.tool, arguments, idempotency_key=args.sent_key,
                                  task_id=args.task, tenant=args.tenant,
                                  wait_s=args.wait if progress is None else None)
        if args.wait > 0:
            left = max(0.0, args.wait - (time.monotonic() - started))
            return _wait(client, submitted.operation, left, progress)
        _print(submitted.operation)
        return EXIT_OK
    if args.command == "show":
        if args.journal:
            _print(client.journal(args.operation_id))
        elif args.receipt:
            _print(client.receipt(args.operation_id))
        elif getattr(args, "wait", 0) > 0:
            progress = _Progress() if sys.stderr.isatty() else None
            return _wait(client, client.get(args.operation_id), args.wait, progress)
        else:
            _print(client.get(args.operation_id))
        return EXIT_OK
    if args.command == "review":
        return _review(client, args)
    if args.command in ("approve", "reject", "cancel", "retry"):
        return _operator(client, args)
    _print(client.list(state=args.state, limit=args.limit, cursor=args.cursor))
    return EXIT_OK


def _operator(client: Client, args: argparse.Namespace) -> int:
    op_id, who = args.operation_id, args.operator
    if args.command == "approve":
        # Approving binds to the exact arguments: by default those shown to you now.
        _print(client.approve(op_id, epoch=args.epoch, arguments_digest=args.arguments_digest,
                              operator=who))
    elif args.command == "reject":
        _print(client.reject(op_id, epoch=args.epoch, reason=args.reason, operator=who))
    elif args.command == "cancel":
        _print(client.cancel(op_id, reason=args.reason, operator=who))
    else:
        if args.review and not args.evidence_ref:
            print("effectledger: --review needs --evidence-ref", file=sys.stderr)
            return EXIT_USAGE
        epoch = args.epoch if args.epoch is not None else client.get(op_id).epoch
        _print(client.retry(op_id, epoch=epoch, review=args.review,
                            evidence_ref=args.evidence_ref, operator=who))
    return EXIT_OK


def _review(client: Client, args: argparse.Namespace) -> int:
    if args.operation_id is None:
        _print(client.review_queue())
        return EXIT_OK
    if not (args.conclusion and args.evidence_ref):
        print("effectledger: a review needs --conclusion and --evidence-ref", file=sys.stderr)
        return EXIT_USAGE
    if args.retry and args.conclusion != "not_executed":
        print("effectledger: --retry only follows a not_executed review", file=sys.stderr)
        return EXIT_USAGE
    op = client.review(args.operation_id, conclusion=args.conclusion,
                       evidence_ref=args.evidence_ref, epoch=args.epoch, operator=args.operator)
    if args.retry:
        _print(client.retry(args.operation_id, epoch=op.epoch, operator=args.operator))
        return EXIT_OK
    _print(op)
    return EXIT_OK
