"""How the catalog and the ledger's answers look to an MCP agent. Pure: no I/O.

- `ANNOTATIONS`: the effect class → MCP tool annotations table (README, "Agents over MCP").
- `input_schema`: the catalog's `input_schema`, else one derived from the tool's
  `{args.<name>}` placeholders (each one a required property).
- `idempotency_key`: where a call's key comes from (SEP-3182's `idempotencyKey`, then
  `_meta["effectledger/idempotencyKey"]`, else derived from the tool and its arguments).
- `render`: an operation as a tool result. An unknown outcome is a result that says "do not
  retry", never an error: an error invites the very retry that could apply the effect twice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from effectledger_core.digest import digest
from effectledger_core.views import OperationView, Receipt

# (readOnlyHint, destructiveHint, idempotentHint, openWorldHint) per effect class. Every tool
# reaches an external provider (open world). An unknown class is assumed the worst.
ANNOTATIONS: dict[str, tuple[bool, bool, bool, bool]] = {
    "read_only": (True, False, True, True),
    "idempotent": (False, False, True, True),
    "reversible": (False, False, False, True),
    "compensatable": (False, True, False, True),
    "non_idempotent": (False, True, False, True),
    "unknown": (False, True, False, True),
}
META_KEY = "effectledger/idempotencyKey"
# How long a tool call waits for its operation to settle (`effectledger mcp --wait`). Here, not
# in server.py, so that the CLI can offer it without importing the MCP SDK.
DEFAULT_WAIT_S = 30.0
META_TASK = "effectledger/taskId"
_ARG = re.compile(r"\{args\.([A-Za-z0-9_]+)((?:\.[A-Za-z0-9_]+)*)\}")


def tool_annotations(effect_class: str) -> dict[str, bool]:
    ro, destructive, idempotent, open_world = ANNOTATIONS.get(effect_class,
                                                             ANNOTATIONS["unknown"])
    return {"readOnlyHint": ro, "destructiveHint": destructive, "idempotentHint": idempotent,
            "openWorldHint": open_world}


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def input_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The catalog's declared schema, else one from the placeholders the call uses."""
    declared = tool.get("input_schema")
    if isinstance(declared, Mapping):
        return dict(declared)
    readback = tool.get("readback") or {}
    texts = _strings([tool.get("endpoint"), tool.get("body"), readback.get("url")])
    props: dict[str, Any] = {}
    for text in texts:
        for name, nested in _ARG.findall(text):
            props[name] = {"type": "object"} if nested else {}
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if props:
        schema["required"] = sorted(props)
    return schema


def idempotency_key(tool: str, arguments: Mapping[str, Any], raw_params: Mapping[str, Any]
                    ) -> tuple[str, str]:
    """(key, where it came from). A retried call carries the same key, so the ledger returns
    the same operation instead of creating a second one."""
    given = raw_params.get("idempotencyKey")
    if isinstance(given, str) and given:
        return given, "idempotencyKey"
    meta = raw_params.get("_meta")
    if isinstance(meta, Mapping):
        given = meta.get(META_KEY)
        if isinstance(given, str) and given:
            return given, "_meta"
    # The same tool with the same arguments is the same decision (within the tenant, and the
    # task when `_meta` names one): to do it twice on purpose, send two different keys.
    return "mcp:" + digest({"tool": tool, "arguments": dict(arguments)}), "derived"


def task_id(raw_params: Mapping[str, Any]) -> str | None:
    meta = raw_params.get("_meta")
    task = meta.get(META_TASK) if isinstance(meta, Mapping) else None
    return task if isinstance(task, str) and task else None


_UNKNOWN = ("The outcome is UNKNOWN: the provider may or may not have applied this effect. "
            "Do NOT retry this call and do not try to achieve the same effect another way. ")
_NEXT = {
    "ambiguous": "effectledger is finding out from the provider (readback or webhook); call "
                 "this tool again with the same arguments to wait for the answer.",
    "awaiting_confirmation": "The provider accepted the request and will confirm it later; "
                             "call this tool again with the same arguments to wait for it.",
    "needs_review": "No machine can tell; an operator will review it. Tell the user the "
                    "outcome is unknown and pending review.",
}


def render(op: OperationView, receipt: Receipt | None) -> tuple[str, dict[str, Any], bool]:
    """(text for the model, structured content, isError) for an operation after a wait."""
    state = op.state
    kept = op.result  # the provider's answer, as the ledger keeps it
    result = kept.value if kept is not None else None
    data: dict[str, Any] = {"state": state, "operation_id": op.id, "tool": op.tool,
                            "epoch": op.epoch, "provider_ref": op.provider_ref,
                            "result": result, "do_not_retry": False}
    if kept is not None and (kept.truncated or kept.omitted):
        data["result_note"] = ("truncated" if kept.truncated
                               else f"omitted: {kept.omitted}")
    if receipt is not None:
        data["receipt"] = {"digests": receipt.digests.model_dump(mode="json"),
                           "provider_request_ref": receipt.provider_request_ref,
                           "open_uncertainties": receipt.open_uncertainties}
    ref = f" Operation {op.id}."
    if state == "succeeded":
        data["outcome"] = "succeeded"
        text = f"Succeeded.{ref}"
        if op.provider_ref:
            text += f" Provider reference: {op.provider_ref}."
        if result is not None:
            text += " Result: " + (result if isinstance(result, str)
                                   else json.dumps(result, sort_keys=True))
        return text, data, False
    if state in ("failed", "cancelled"):
        data["outcome"] = state
        guidance = receipt.guidance if receipt is not None else None
        data["guidance"] = guidance
        what = "Cancelled before any attempt: nothing was applied." if state == "cancelled" \
            else "Failed: the provider refused it and nothing was applied."
        return f"{what}{ref}" + (f" {guidance}" if guidance else ""), data, True
    if state in _NEXT:
        data.update(outcome="unknown", do_not_retry=True, next=_NEXT[state])
        return f"{_UNKNOWN}{_NEXT[state]}{ref}", data, False
    if state == "awaiting_approval":
        data.update(outcome="awaiting_approval",
                    next="An operator must approve these exact arguments first.")
        return ("Awaiting an operator's approval: nothing has been done yet. Call this tool "
                f"again with the same arguments to wait for the decision.{ref}"), data, False
    data.update(outcome="in_progress",
                next="call this tool again with the same arguments to keep waiting")
    return (f"Still in progress ({state}). Calling this tool again with the same arguments "
            f"waits for the same operation; it will not run twice.{ref}"), data, False
