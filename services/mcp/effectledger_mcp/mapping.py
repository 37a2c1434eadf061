"""How the catalog and the ledger's answers look to an MCP agent. Pure: no I/O.

- `tool_annotations`: the (effect class, reversibility) → MCP tool annotations table
  (docs/agents.md, "Annotations").
- `published_schema`: the catalog's input schema as listed, with the reserved `repeat`
  argument of every tool that changes something.
- `idempotency_key`: a key the host sent (SEP-3182's `idempotencyKey`, then
  `_meta["effectledger/idempotencyKey"]`); without one the ledger joins identical calls.
- `render`: an operation as a tool result; the text is the structured content rendered, so a
  framework that shows the model only one of them loses nothing. An unknown outcome is a result
  that says "do not retry", never an error: an error invites the very retry that could apply
  the effect twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from effectledger_core.failures import Failure, Idempotency
from effectledger_core.messages import FailureClass
from effectledger_core.states import TERMINAL, UNKNOWN_NEXT_STEP, State
from effectledger_core.views import OperationView

META_KEY = "effectledger/idempotencyKey"
META_TASK = "effectledger/taskId"
# The argument a model sets to do the same thing again on purpose (a second, separate effect).
REPEAT = "repeat"
STATUS_TOOL = "operation_status"
RESOURCE_PREFIX = "effectledger://operations/"

# One table over the effect class and the reversibility (docs/agents.md, "Annotations"):
# (readOnlyHint, destructiveHint, idempotentHint, openWorldHint). destructiveHint is about the
# world, not about retries: an idempotent charge is still destructive. Every tool reaches an
# external provider (open world); an unknown class is assumed the worst.
ANNOTATIONS: dict[tuple[str, str], tuple[bool, bool, bool, bool]] = {
    ("read_only", "undoable"): (True, False, True, True),
    ("read_only", "irreversible"): (True, False, True, True),
    ("idempotent", "undoable"): (False, False, True, True),
    ("idempotent", "irreversible"): (False, True, True, True),
    ("reversible", "undoable"): (False, False, False, True),
    ("reversible", "irreversible"): (False, True, False, True),
    # A compensation is a second effect, not an undo: the first one happened.
    ("compensatable", "undoable"): (False, True, False, True),
    ("compensatable", "irreversible"): (False, True, False, True),
    ("non_idempotent", "undoable"): (False, False, False, True),
    ("non_idempotent", "irreversible"): (False, True, False, True),
    ("unknown", "undoable"): (False, True, False, True),
    ("unknown", "irreversible"): (False, True, False, True),
}


def reversibility(tool: Mapping[str, Any]) -> str:
    """The catalog's `reversibility`, else the effect class's default."""
    declared = tool.get("reversibility")
    if declared in ("undoable", "irreversible"):
        return str(declared)
    return "undoable" if tool.get("effect_class") == "reversible" else "irreversible"


def tool_annotations(tool: Mapping[str, Any]) -> dict[str, Any]:
    effect = str(tool.get("effect_class", "unknown"))
    ro, destructive, idempotent, open_world = ANNOTATIONS.get(
        (effect, reversibility(tool)), ANNOTATIONS[("unknown", "irreversible")])
    return {"title": title(tool), "readOnlyHint": ro, "destructiveHint": destructive,
            "idempotentHint": idempotent, "openWorldHint": open_world}


def title(tool: Mapping[str, Any]) -> str:
    given = tool.get("title")
    if isinstance(given, str) and given:
        return given
    return str(tool.get("name", "")).replace("_", " ").capitalize()


def joins_identical(tool: Mapping[str, Any]) -> bool:
    """Whether an identical call joins the earlier operation (everything but a lookup: a
    lookup asked again should look again)."""
    return tool.get("effect_class") != "read_only"


_REPEAT_PROPERTY = {
    "type": ["string", "null"],
    "description": "Leave null. Only to do this same thing AGAIN on purpose as a second, "
                   "separate effect (the user asked for it twice), set a new short label such "
                   "as \"2\". A call with the same arguments and the same repeat value is the "
                   "same call: it never runs twice.",
    "examples": [None, "2"],
}


def published_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The input schema as listed: the catalog's, plus `repeat` when identical calls join.

    `repeat` is listed as required and nullable (OpenAI's strict mode wants every property
    required); the server treats a missing `repeat` as null, so other clients may omit it."""
    schema = dict(tool.get("input_schema") or {"type": "object", "properties": {}})
    schema.pop("$schema", None)
    if not joins_identical(tool):
        return schema
    props = dict(schema.get("properties") or {})
    if REPEAT in props:  # the catalog's own argument of that name wins; no repeat then
        return schema
    props[REPEAT] = _REPEAT_PROPERTY
    schema["properties"] = props
    schema["required"] = [*(schema.get("required") or []), REPEAT]
    return schema


def strict_problems(schema: Mapping[str, Any], where: str = "") -> list[str]:
    """What keeps a schema out of OpenAI's strict function mode: every object closed
    (`additionalProperties: false`) with every property typed and required."""
    problems = []
    if schema.get("type") == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        if schema.get("additionalProperties") is not False:
            problems.append(f"{where or '/'}: additionalProperties must be false")
        missing = sorted(set(props) - set(schema.get("required") or []))
        if missing:
            problems.append(f"{where or '/'}: not required: {', '.join(missing)}")
        for name, sub in props.items():
            if not isinstance(sub, Mapping) or not ("type" in sub or "anyOf" in sub
                                                    or "enum" in sub):
                problems.append(f"{where}/{name}: no type")
            elif isinstance(sub, Mapping):
                problems += strict_problems(sub, f"{where}/{name}")
    items = schema.get("items")
    if isinstance(items, Mapping):
        problems += strict_problems(items, f"{where}/items")
    return problems


def description(tool: Mapping[str, Any]) -> str:
    """The catalog's description, then what every model must know about calling it."""
    text = str(tool.get("description") or title(tool)).strip()
    if not joins_identical(tool):
        return text
    return (f"{text}\n\nRuns at most once per call: calling again with the same arguments "
            "joins the first call (after an error, a timeout or an unknown outcome too), it "
            "never does it twice. To do it again on purpose, set `repeat` to a new label. If a "
            f"result says the outcome is unknown, do not retry: ask `{STATUS_TOOL}`.")


def idempotency_key(raw_params: Mapping[str, Any]) -> tuple[str | None, str]:
    """(key, where it came from): SEP-3182's `idempotencyKey`, then `_meta`, else none (the
    ledger then joins identical calls by their call identity)."""
    given = raw_params.get("idempotencyKey")
    if isinstance(given, str) and given:
        return given, "idempotencyKey"
    meta = raw_params.get("_meta")
    if isinstance(meta, Mapping):
        given = meta.get(META_KEY)
        if isinstance(given, str) and given:
            return given, "_meta"
    return None, "none"


def task_id(raw_params: Mapping[str, Any]) -> str | None:
    meta = raw_params.get("_meta")
    task = meta.get(META_TASK) if isinstance(meta, Mapping) else None
    return task if isinstance(task, str) and task else None


def resource_uri(operation_id: str) -> str:
    return RESOURCE_PREFIX + operation_id


# -- results ----------------------------------------------------------------------------------

# Who decided a settled outcome, from the evidence the ledger kept.
_DECIDERS = {"readback": "readback", "webhook": "webhook", "operator": "operator_review",
             "response": "provider"}


def decided_by(op: OperationView) -> str | None:
    if op.state not in TERMINAL:
        return None
    if op.state == State.CANCELLED:
        return "operator"
    source = (op.evidence or {}).get("source")
    return _DECIDERS.get(str(source), "provider")


def guidance(op: OperationView) -> str | None:
    """The failure's one line for the model (the ledger's receipt renders the same)."""
    last = op.last_outcome or {}
    if last.get("type") != "attempt_failed":
        return None
    if last.get("guidance"):
        return str(last["guidance"])
    try:
        failure = Failure(FailureClass(last["failure_class"]), last.get("code", ""),
                          last.get("message", ""), retry_after_s=last.get("retry_after_s"),
                          idempotency=Idempotency(last.get("idempotency", "unset")))
    except (KeyError, ValueError):
        return None
    return failure.guidance()


_UNKNOWN = ("The outcome is UNKNOWN: the provider may or may not have applied this effect. "
            "Do NOT retry it with other arguments or a new repeat label, and do not try to "
            "achieve the same effect another way.")


def render(op: OperationView, *, replayed: bool | None, repeat: str | None = None,
           extra: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any], bool]:
    """(text, structured content, isError) for an operation: after a call (`replayed` says
    whether the call joined an earlier operation) or for the status tool (`replayed` None)."""
    state = op.state
    kept = op.result  # the provider's answer, as the ledger keeps it
    key = op.caller_key
    data: dict[str, Any] = {
        "outcome": "in_progress", "state": state, "operation_id": op.id, "tool": op.tool,
        "idempotency_key": key, "replayed": replayed, "repeat": repeat,
        "decided_by": decided_by(op), "provider_ref": op.provider_ref,
        "result": kept.value if kept is not None else None, "do_not_retry": False,
        "message": "", "warning": None, "next": None, "guidance": None,
        "safe_recall": {"tool": op.tool, "arguments": _recall_arguments(op, repeat),
                        "idempotency_key": key},
        "check_status": {"tool": STATUS_TOOL, "arguments": {"operation_id": op.id},
                         "resource": resource_uri(op.id)},
    }
    if kept is not None and (kept.truncated or kept.omitted):
        data["result_note"] = "truncated" if kept.truncated else f"omitted: {kept.omitted}"
    is_error = False
    if state == State.SUCCEEDED:
        data.update(outcome="succeeded", message="Succeeded.")
    elif state in (State.FAILED, State.CANCELLED):
        is_error = True
        data.update(outcome=state, guidance=guidance(op), message=(
            "Cancelled: nothing was applied." if state == State.CANCELLED
            else "Failed: the provider refused it and nothing was applied."),
            next="Once the cause is fixed, calling again with the same arguments runs it "
                 "anew (a failed or cancelled call is never joined).")
    elif state in UNKNOWN_NEXT_STEP:
        data.update(outcome="unknown", do_not_retry=True, warning=_UNKNOWN,
                    message="Outcome unknown.", next=(
                        f"{UNKNOWN_NEXT_STEP[state]} Learn the outcome with {STATUS_TOOL} "
                        f"(operation_id "
                        f"{op.id}); calling this tool again with the same arguments only waits "
                        "for the same operation."))
    elif state == State.AWAITING_APPROVAL:
        data.update(outcome="awaiting_approval",
                    message="Awaiting an operator's approval: nothing has been done yet.",
                    next=f"Ask {STATUS_TOOL} (operation_id {op.id}) for the decision; the same "
                         "call again waits on the same operation.")
    else:
        data.update(message=f"Still in progress ({state}); it will not run twice.",
                    next=f"Ask {STATUS_TOOL} (operation_id {op.id}), which can wait, or call "
                         "again with the same arguments: it joins this operation.")
    if extra:
        data.update(extra)
    return text_of(data), data, is_error


def _recall_arguments(op: OperationView, repeat: str | None) -> dict[str, Any]:
    args = dict(op.arguments)
    if repeat is not None:
        args[REPEAT] = repeat
    return args


def text_of(data: Mapping[str, Any]) -> str:
    """The structured content rendered for a model that reads only text."""
    lines = [f"{data['message']} Operation {data['operation_id']} ({data['tool']}), "
             f"idempotency key {data['idempotency_key']!s}"
             + (", a replay of an earlier identical call" if data.get("replayed") else "")
             + "."]
    if data.get("warning"):
        lines.append(f"WARNING: {data['warning']}")
    if data.get("guidance"):
        lines.append(f"Guidance: {data['guidance']}")
    if data.get("next"):
        lines.append(f"Next: {data['next']}")
    recall = data.get("safe_recall")
    if recall and data.get("outcome") not in ("succeeded", "failed", "cancelled"):
        lines.append(f"Safe re-call: {recall['tool']} with arguments "
                     f"{json.dumps(recall['arguments'], sort_keys=True)} and idempotency key "
                     f"{recall['idempotency_key']!s} joins this operation; it never runs twice.")
    if data.get("decided_by"):
        lines.append(f"Decided by: {data['decided_by']}.")
    if data.get("provider_ref"):
        lines.append(f"Provider reference: {data['provider_ref']}.")
    if data.get("result") is not None:
        result = data["result"]
        lines.append("Result: " + (result if isinstance(result, str)
                                   else json.dumps(result, sort_keys=True)))
    lines.append("Structured: " + json.dumps(data, sort_keys=True, default=str))
    return "\n".join(lines)


def error_result(kind: str, message: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    """(text, structured content) of a call refused before or at submission."""
    data = {"outcome": "refused", "error": kind, "message": message, **fields}
    return message + "\nStructured: " + json.dumps(data, sort_keys=True, default=str), data


def expected_at(schema: Mapping[str, Any], pointer: str) -> str | None:
    """What the schema expects at a JSON pointer: its type, description and an example."""
    node: Any = schema
    for part in [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]:
        if not isinstance(node, Mapping):
            return None
        node = (node.get("properties") or {}).get(part) if "properties" in node \
            else node.get("items")
    if not isinstance(node, Mapping) or node is schema:
        return None
    bits = []
    if "type" in node:
        bits.append(f"type {json.dumps(node['type'])}")
    if "enum" in node:
        bits.append(f"one of {json.dumps(node['enum'])}")
    if node.get("description"):
        bits.append(str(node["description"]))
    if node.get("examples"):
        bits.append(f"e.g. {json.dumps(node['examples'][0])}")
    return "; ".join(bits) or None


# The structured result's schema (tools' outputSchema). Loose where the provider speaks
# (`result`), exact where a framework branches (`outcome`, `do_not_retry`).
OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "outcome": {"type": "string", "enum": [
            "succeeded", "failed", "cancelled", "unknown", "awaiting_approval", "in_progress",
            "refused"]},
        "state": {"type": "string"},
        "operation_id": {"type": "string"},
        "tool": {"type": "string"},
        "idempotency_key": {"type": ["string", "null"]},
        "replayed": {"type": ["boolean", "null"],
                     "description": "true: this call joined an earlier identical call"},
        "repeat": {"type": ["string", "null"]},
        "decided_by": {"type": ["string", "null"], "enum": [
            "provider", "readback", "webhook", "operator_review", "operator", None]},
        "provider_ref": {"type": ["string", "null"]},
        "result": {"description": "the provider's answer (JSON or text), if any"},
        "result_note": {"type": "string"},
        "do_not_retry": {"type": "boolean"},
        "message": {"type": "string"},
        "warning": {"type": ["string", "null"]},
        "next": {"type": ["string", "null"]},
        "guidance": {"type": ["string", "null"]},
        "safe_recall": {"type": "object"},
        "check_status": {"type": "object"},
        "error": {"type": "string"},
        "errors": {"type": "array"},
        "retry_after_s": {"type": ["number", "null"]},
        "open_uncertainties": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["outcome", "message"],
}
