"""`submit`, `show` and `list`: a thin HTTP client of the ledger API."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import httpx

AT_REST = {"succeeded", "failed", "cancelled", "needs_review"}


def _print(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def _check(resp: httpx.Response) -> Any:
    try:
        body = resp.json()
    except ValueError:
        body = {"error": {"code": "http_error", "message": resp.text[:500]}}
    if resp.status_code >= 400:
        err = body.get("error", {}) if isinstance(body, dict) else {}
        print(f"effectledger: HTTP {resp.status_code} {err.get('code')}: {err.get('message')}",
              file=sys.stderr)
        if err.get("details"):
            print(json.dumps(err["details"], indent=2), file=sys.stderr)
        raise SystemExit(1)
    return body


def run(args: argparse.Namespace) -> int:
    # Agents and operators authenticate with a bearer token (EFFECTLEDGER_TOKEN).
    token = os.environ.get("EFFECTLEDGER_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=args.ledger_url, timeout=10.0, headers=headers) as http:
            return _run(http, args)
    except httpx.TransportError as exc:
        print(f"effectledger: cannot reach the ledger at {args.ledger_url}: {exc}",
              file=sys.stderr)
        return 1


def _run(http: httpx.Client, args: argparse.Namespace) -> int:
    if args.command == "submit":
        try:
            arguments = json.loads(args.args)
        except json.JSONDecodeError as exc:
            print(f"effectledger: --args is not valid JSON: {exc}", file=sys.stderr)
            return 2
        body: dict[str, Any] = {"tool": args.tool, "arguments": arguments}
        if args.key:
            body["idempotency_key"] = args.key
        if args.task:
            body["task_id"] = args.task
        if args.tenant:
            body["tenant"] = args.tenant
        op = _check(http.post("/v1/intents", json=body))
        deadline = time.monotonic() + args.wait
        while op["state"] not in AT_REST and time.monotonic() < deadline:
            time.sleep(0.2)  # polling the API; the ledger has no push channel for the CLI
            op = _check(http.get(f"/v1/operations/{op['id']}"))
        _print(op)
        return 0
    if args.command == "show":
        if args.journal:
            _print(_check(http.get(f"/v1/operations/{args.operation_id}/journal")))
        elif args.receipt:
            _print(_check(http.get(f"/v1/operations/{args.operation_id}/receipt")))
        else:
            _print(_check(http.get(f"/v1/operations/{args.operation_id}")))
        return 0
    if args.command == "review":
        return _review(http, args)
    if args.command in ("approve", "reject", "cancel", "retry"):
        return _operator(http, args)
    params: dict[str, Any] = {"limit": args.limit}
    if args.state:
        params["state"] = args.state
    if args.cursor:
        params["cursor"] = args.cursor
    _print(_check(http.get("/v1/operations", params=params)))
    return 0


def _operator(http: httpx.Client, args: argparse.Namespace) -> int:
    op_id = args.operation_id
    op = _check(http.get(f"/v1/operations/{op_id}"))
    epoch = args.epoch if args.epoch is not None else op["epoch"]
    body: dict[str, Any] = {"operator": args.operator}
    if args.command == "approve":
        # Approving binds to the exact arguments: by default those shown to you now.
        body.update(epoch=epoch, arguments_digest=args.arguments_digest or op["arguments_digest"])
    elif args.command == "reject":
        body.update(epoch=epoch, reason=args.reason)
    elif args.command == "cancel":
        body.update(reason=args.reason)
    else:
        body["epoch"] = epoch
        if args.review:
            if not args.evidence_ref:
                print("effectledger: --review needs --evidence-ref", file=sys.stderr)
                return 2
            body["review"] = {"conclusion": args.review, "evidence_ref": args.evidence_ref,
                              "operator": args.operator}
    _print(_check(http.post(f"/v1/operations/{op_id}/{args.command}", json=body)))
    return 0


def _review(http: httpx.Client, args: argparse.Namespace) -> int:
    if args.operation_id is None:
        _print(_check(http.get("/v1/reviews")))
        return 0
    if not (args.conclusion and args.evidence_ref):
        print("effectledger: a review needs --conclusion and --evidence-ref", file=sys.stderr)
        return 2
    body: dict[str, Any] = {"conclusion": args.conclusion, "evidence_ref": args.evidence_ref}
    if args.operator:
        body["operator"] = args.operator
    if args.epoch is not None:
        body["epoch"] = args.epoch
    op = _check(http.post(f"/v1/operations/{args.operation_id}/reviews", json=body))
    if args.retry:
        if args.conclusion != "not_executed":
            print("effectledger: --retry only follows a not_executed review", file=sys.stderr)
            return 2
        retry_body: dict[str, Any] = {"epoch": op["epoch"]}
        if args.operator:
            retry_body["operator"] = args.operator
        op = _check(http.post(f"/v1/operations/{args.operation_id}/retry", json=retry_body))
    _print(op)
    return 0
