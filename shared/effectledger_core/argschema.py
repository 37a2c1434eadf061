"""Checking an intent's arguments against its tool's input schema, at admission.

An intent the provider can never be sent (a missing `{args.amount}`, a string where the provider
needs an integer) is refused before anything is stored or enqueued, with the JSON pointer
(RFC 6901) of each bad field, instead of failing later at dispatch.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from .catalog import PerTool, Tool, tool_input_schema
from .digest import canonical_json
from .errors import InvalidArguments

MAX_REPORTED = 20


def pointer(path: list[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


@lru_cache(maxsize=512)
def _compile(schema_json: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(schema_json),
                                format_checker=Draft202012Validator.FORMAT_CHECKER)


# Admission is the ledger's hot path: the validator is found by the Tool object itself, so the
# schema is not rebuilt and serialised per intent.
_validator: PerTool[Draft202012Validator] = PerTool(
    lambda tool: _compile(canonical_json(tool_input_schema(tool))))


def _problems(error: ValidationError) -> list[dict[str, str]]:
    """One entry per bad field; a missing or unexpected property is pointed at itself."""
    base = list(error.absolute_path)
    instance = error.instance
    if error.validator == "required" and isinstance(instance, dict):
        return [{"pointer": pointer([*base, name]), "message": f"{name!r} is required"}
                for name in error.validator_value if name not in instance]
    if error.validator == "additionalProperties" and isinstance(instance, dict):
        known = set((error.schema or {}).get("properties", {}))
        extra = [k for k in instance if k not in known]
        if extra and not (error.schema or {}).get("patternProperties"):
            return [{"pointer": pointer([*base, k]), "message": "not allowed by the schema"}
                    for k in extra]
    return [{"pointer": pointer(base), "message": error.message[:300]}]


def schema_errors(tool: Tool, arguments: dict[str, Any]) -> list[dict[str, str]]:
    """Every violation of the tool's input schema, each with its JSON pointer (sorted)."""
    return _errors(_validator(tool), arguments)


def errors_against(schema: dict[str, Any], arguments: dict[str, Any]) -> list[dict[str, str]]:
    """`schema_errors` for a schema as published (the MCP server checks a call with the
    schema it listed, before anything is submitted)."""
    return _errors(_compile(canonical_json(schema)), arguments)


def _errors(validator: Draft202012Validator, arguments: dict[str, Any]) -> list[dict[str, str]]:
    seen: dict[str, dict[str, str]] = {}
    for error in validator.iter_errors(arguments):
        for p in _problems(error):
            seen.setdefault(p["pointer"] + "\x00" + p["message"], p)
    return sorted(seen.values(), key=lambda p: (p["pointer"], p["message"]))[:MAX_REPORTED]


def check_arguments(tool: Tool, arguments: dict[str, Any]) -> None:
    """Raise InvalidArguments (422) listing each bad field if the arguments do not fit."""
    errors = schema_errors(tool, arguments)
    if errors:
        where = ", ".join(e["pointer"] or "/" for e in errors[:5])
        raise InvalidArguments(
            f"arguments do not match the input schema of tool {tool.name!r} at {where}",
            tool=tool.name, errors=errors)
