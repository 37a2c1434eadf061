"""The catalog reference: every field of `[tools.<name>]` and `[webhooks.<provider>]`, read
from the pydantic models that parse the catalog (types, defaults, bounds) and the comments the
code keeps beside each field (the meaning)."""

from __future__ import annotations

import ast
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .md import banner, code, prose, table


def field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Each field's comment: the block of `#` lines right above it and a comment at the end of
    its own line."""
    source = textwrap.dedent(inspect.getsource(model))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef), model
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        block: list[str] = []
        line = node.lineno - 1
        while line >= 1 and line in comments and lines[line - 1].lstrip().startswith("#"):
            block.insert(0, comments[line])
            line -= 1
        trailing = comments.get(node.lineno, "") if not lines[node.lineno - 1].lstrip(
        ).startswith("#") else ""
        out[node.target.id] = " ".join([*block, trailing]).strip()
    return out


def _type(annotation: Any) -> str:
    if isinstance(annotation, type) and not getattr(annotation, "__args__", None):
        return annotation.__name__
    return re.sub(r"\b(?:[a-z_][a-z0-9_]*\.)+(?=[A-Za-z_])", "", str(annotation))


def _bounds(info: FieldInfo) -> str:
    parts = []
    for meta in info.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"),
                           ("min_length", "length ≥"), ("max_length", "length ≤")):
            bound = getattr(meta, attr, None)
            if bound is not None:
                parts.append(f"{sign} {bound}")
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        return code(getattr(info.default_factory, "__name__", "factory") + "()")
    default = info.default
    if isinstance(default, BaseModel):
        return code(default.model_dump(exclude_defaults=True) or "{}")
    return code(getattr(default, "value", default))


def model_table(model: type[BaseModel], skip: frozenset[str] = frozenset(), *,
                notes: dict[str, str] | None = None,
                rename: Callable[[str], str] | None = None, first: str = "field") -> str:
    """One row per field: its name (as `rename` writes it), type, default, bounds, meaning."""
    notes = field_comments(model) if notes is None else notes
    rows = [(code(rename(name) if rename else name), code(_type(info.annotation)),
             _default(info), _bounds(info), prose(notes.get(name, "")))
            for name, info in model.model_fields.items() if name not in skip]
    return table([first, "type", "default", "bounds", "meaning"], rows)


def render() -> str:
    from effectledger_core.catalog import Capabilities, FoundWhen, Readback, Tool
    from effectledger_core.webhookspec import WebhookProvider

    sections: list[tuple[str, str, type[BaseModel], frozenset[str]]] = [
        ("`[tools.<name>]`", "One table per tool; the table's key is the tool's name.",
         Tool, frozenset({"name"})),
        ("`capabilities`", "What the provider can do for us (`capabilities = { … }`).",
         Capabilities, frozenset()),
        ("`[tools.<name>.readback]`", "How the reconciler asks the provider whether an effect "
         "happened.", Readback, frozenset()),
        ("`readback.found_when`", "Exactly one of the two rules.", FoundWhen, frozenset()),
        ("`[webhooks.<provider>]`", "A provider's own signed webhooks; the table's key is "
         "the provider's name.", WebhookProvider, frozenset({"name"})),
    ]
    out = ["# Catalog fields\n", banner("effectledger_docsgen.catalog"),
           "Every field the catalog's models accept, with its type, default and bounds. "
           "Unknown fields are refused (the catalog fails at start, naming the tool and the "
           "field). [The catalog guide](../catalog.md) explains the fields with worked "
           "examples.\n"]
    for title, intro, model, skip in sections:
        out += [f"## {title}\n", intro + "\n", model_table(model, skip)]
    return "\n".join(out)
