"""What the agent-framework integrations share; no framework is imported here.

- `call_key`: the idempotency key of one tool call, from the framework's own identity of that
  call (its tool-call id within a run or thread). A framework that runs the same call again (a
  durable replay, a graph resumed from its checkpoint, a retried step) sends the same key, so
  the ledger answers with the first operation instead of applying the effect twice.
- `LedgerCalls`: the catalog as tool specs, one call through the ledger (submit, then wait),
  and the status of an operation (`effectledger_status`).
- `Answer`: what the model sees. Every outcome is an answer, never an exception: frameworks
  turn a tool's exception into "an error occurred, try again", which after an unknown outcome
  is exactly the retry that could apply the effect twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from effectledger_client import AsyncClient, LedgerError, OperationView
from effectledger_client.errors import IdempotencyConflict, NotFound, Unavailable
from effectledger_core.digest import sha256_hex
from effectledger_core.states import UNKNOWN_NEXT_STEP, State

DEFAULT_WAIT_S = 20.0
# A submission the ledger did not answer is sent again with the same key for this long: the
# same key finds the same operation, so this never creates a second one.
DEFAULT_SUBMIT_RETRY_S = 5.0
STATUS_TOOL = "effectledger_status"
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"operation_id": {
        "type": "string",
        "description": "The operation_id from an earlier effectledger tool result."}},
    "required": ["operation_id"], "additionalProperties": False}
STATUS_DESCRIPTION = (
    "The outcome of an earlier effectledger tool call, by its operation_id: waits briefly for it "
    "to settle and answers with the same fields as the call. Use it whenever a result says the "
    "outcome is unknown, still in progress or awaiting approval; it never repeats the effect.")

_UNKNOWN = ("The outcome is UNKNOWN: the provider may or may not have applied this effect. Do "
            "NOT retry this call and do not try to achieve the same effect another way.")


def call_key(framework: str, call_id: str, *scope: str | None) -> str:
    """`<framework>:<digest>` of the call's identity: the scope (run, thread, conversation:
    where the framework's call ids are unique) and the tool-call id. A digest, so that no
    separator inside an id can make two identities one key, and the key stays short."""
    parts = [p for p in scope if p] + [call_id]
    return f"{framework}:{sha256_hex(json.dumps(parts, ensure_ascii=False))[:40]}"


@dataclass(frozen=True)
class ToolSpec:
    """One catalog tool as a function tool: its name, a description written for a model and
    its arguments' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]
    effect_class: str


@dataclass(frozen=True)
class Answer:
    """A tool result. `data` is what a framework passing structured results shows; `text` is
    the same object as JSON (for frameworks that pass strings): each carries the message with
    the warning and the next step, so a model shown only one of them loses nothing."""

    data: dict[str, Any]

    @property
    def text(self) -> str:
        return json.dumps(self.data, ensure_ascii=False, default=str)

    @property
    def outcome(self) -> str:
        return str(self.data["outcome"])

    @property
    def do_not_retry(self) -> bool:
        return bool(self.data.get("do_not_retry"))


def _status_hint(op_id: str) -> str:
    return f'To learn the outcome, call {STATUS_TOOL} with operation_id "{op_id}".'


def render(op: OperationView, *, key: str | None, replayed: bool | None = None) -> Answer:
    """An operation, as the model should see it after a wait."""
    data: dict[str, Any] = {"outcome": "", "message": "", "state": op.state,
                            "operation_id": op.id, "idempotency_key": key or op.caller_key,
                            "tool": op.tool, "do_not_retry": False}
    if replayed is not None:
        # This call found an earlier operation with its key: the effect ran (at most) once.
        data["replayed"] = replayed
    evidence = (op.evidence or {}).get("source") if isinstance(op.evidence, dict) else None
    if evidence:
        data["decided_by"] = evidence
    state, ref = op.state, f" Operation {op.id}."
    if state == State.SUCCEEDED:
        data.update(outcome="succeeded", provider_ref=op.provider_ref,
                    result=op.result.value if op.result is not None else None)
        if op.result is not None and (op.result.truncated or op.result.omitted):
            data["result_note"] = ("truncated" if op.result.truncated
                                   else f"omitted: {op.result.omitted}")
        again = " (an earlier call with this key; applied once)" if replayed else ""
        data["message"] = f"Succeeded{again}.{ref}"
    elif state in (State.FAILED, State.CANCELLED):
        what = ("Cancelled before any attempt: nothing was applied." if state == State.CANCELLED
                else "Failed: the provider refused it and nothing was applied.")
        data.update(outcome=state, message=what + ref, last_outcome=op.last_outcome)
    elif state in UNKNOWN_NEXT_STEP:
        data.update(outcome="unknown", do_not_retry=True,
                    message=f"{_UNKNOWN} {UNKNOWN_NEXT_STEP[state]} {_status_hint(op.id)}{ref}")
    elif state == State.AWAITING_APPROVAL:
        data.update(outcome="awaiting_approval", do_not_retry=True, message=(
            "Awaiting an operator's approval: nothing has been done yet. Do not call this tool "
            f"again for the same effect. {_status_hint(op.id)}{ref}"))
    else:  # pending, in_flight: the wait ended first
        data.update(outcome="in_progress", do_not_retry=True, message=(
            f"Still in progress ({state}); it will not run twice. Do not call this tool again "
            f"for the same effect. {_status_hint(op.id)}{ref}"))
    return Answer(data)


def unreachable(tool: str, key: str, exc: LedgerError) -> Answer:
    """The ledger did not answer the submission, even sent again with the same key."""
    return Answer({
        "outcome": "unknown", "do_not_retry": True, "state": None, "operation_id": None,
        "idempotency_key": key, "tool": tool, "error": exc.code,
        "message": ("effectledger could not be reached, so whether it received this request "
                    f"is unknown. {_UNKNOWN} Tell the user. Running this same tool call again "
                    "(the framework's own retry, same call id) is safe: it carries the same "
                    "idempotency key and finds the first operation.")})


def refused(tool: str, key: str | None, exc: LedgerError) -> Answer:
    """The ledger refused the request: nothing was submitted (bad arguments, unknown tool, a
    key reused with other arguments, no permission, a quota)."""
    if isinstance(exc, IdempotencyConflict):
        why = ("this tool call's idempotency key was already used with different arguments; "
               "nothing new was submitted")
    else:
        why = exc.message or exc.code
    data: dict[str, Any] = {
        "outcome": "refused", "do_not_retry": False, "state": None, "operation_id": None,
        "idempotency_key": key, "tool": tool, "error": exc.code,
        "message": f"Refused by effectledger, nothing was submitted: {why}. Correct the call "
                   "before calling again."}
    if exc.details is not None:
        data["details"] = exc.details
    return Answer(data)


class LedgerCalls:
    """Tool calls through the ledger on one `AsyncClient` (its token decides the tenant)."""

    def __init__(self, client: AsyncClient, *, tools: Iterable[str] | None = None,
                 wait_s: float = DEFAULT_WAIT_S, submit_retry_s: float = DEFAULT_SUBMIT_RETRY_S,
                 catalog_ttl_s: float = 10.0) -> None:
        self.client = client
        self.only = frozenset(tools) if tools is not None else None
        self.wait_s = wait_s
        self.submit_retry_s = submit_retry_s
        self.catalog_ttl_s = catalog_ttl_s
        self._cached: tuple[float, list[ToolSpec]] | None = None

    async def specs(self) -> list[ToolSpec]:
        """The catalog's tools (or the chosen ones), cached for `catalog_ttl_s`."""
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < self.catalog_ttl_s:
            return self._cached[1]
        listing = await self.client.tools()
        specs = [_spec(t) for t in listing.tools
                 if self.only is None or t.get("name") in self.only]
        if self.only is not None:
            missing = self.only - {s.name for s in specs}
            if missing:
                raise ValueError(f"not in the ledger's catalog: {sorted(missing)}")
        self._cached = (now, specs)
        return specs

    async def call(self, tool: str, arguments: dict[str, Any], *, key: str,
                   task_id: str | None = None) -> Answer:
        """Submit under `key`, wait up to `wait_s`, answer. Never raises a `LedgerError`."""
        started = time.monotonic()
        deadline = started + self.submit_retry_s
        delay = 0.1
        while True:
            try:
                submitted = await self.client.submit(tool, arguments, idempotency_key=key,
                                                     task_id=task_id, wait_s=self.wait_s)
                break
            except Unavailable as exc:
                if time.monotonic() + delay > deadline:
                    return unreachable(tool, key, exc)
                await asyncio.sleep(delay)  # back off before the same submission again
                delay = min(delay * 2, 1.0)
            except LedgerError as exc:
                return refused(tool, key, exc)
        op = submitted.operation
        # The submission waited already; the rest of `wait_s` is left only when the ledger
        # capped that wait below it.
        remaining = self.wait_s - (time.monotonic() - started)
        if not op.settled and remaining > 0:
            try:
                op = await self.client.wait(op.id, remaining, current=op)
            except LedgerError:
                pass  # the submission is recorded: the answer says how to ask for its status
        return render(op, key=key, replayed=not submitted.created)

    async def status(self, arguments: dict[str, Any]) -> Answer:
        """`effectledger_status`: the operation once settled (or as it is after the wait)."""
        operation_id = arguments.get("operation_id")
        if not isinstance(operation_id, str) or not operation_id:
            return Answer({"outcome": "refused", "do_not_retry": False, "state": None,
                           "operation_id": None, "tool": STATUS_TOOL, "error": "invalid_request",
                           "message": "operation_id (a string from an earlier result) is "
                                      "required."})
        try:
            op = await self.client.wait(operation_id, self.wait_s)
        except NotFound as exc:
            return refused(STATUS_TOOL, None, exc)
        except Unavailable as exc:
            return Answer({"outcome": "unknown", "do_not_retry": True, "state": None,
                           "operation_id": operation_id, "error": exc.code,
                           "message": "effectledger could not be reached; the operation is "
                                      f"unchanged by this. {_status_hint(operation_id)} later."})
        except LedgerError as exc:
            return refused(STATUS_TOOL, None, exc)
        return render(op, key=None)


def _spec(tool: dict[str, Any]) -> ToolSpec:
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        schema = {"type": "object", "properties": {}}
    description = str(tool.get("description") or tool["name"])
    effect_class = str(tool.get("effect_class", "unknown"))
    # What the model must know about every such tool, whatever its catalog description says.
    description += (" Runs through effectledger: applied at most once per call; if the result "
                    f"says do_not_retry, do not call again but use {STATUS_TOOL}.")
    return ToolSpec(str(tool["name"]), description, schema, effect_class)
