"""Small Markdown helpers shared by the reference pages."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from typing import Any


def cell(text: object) -> str:
    """One table cell: pipes escaped, newlines folded (a cell is one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def prose(text: object) -> str:
    """Text written for the code (help strings, docstrings, comments) made safe for Markdown:
    `<prefix>` outside code spans would be read as an HTML tag and vanish from the page."""
    out, last = [], 0
    s = str(text)
    for m in CODE_SPAN.finditer(s):
        out.append(_escape(s[last:m.start()]))
        out.append(m.group(0))
        last = m.end()
    out.append(_escape(s[last:]))
    return "".join(out)


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def code(text: object) -> str:
    """Inline code that survives backticks inside the text."""
    s = str(text)
    fence = "``" if "`" in s else "`"
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def value(v: Any) -> str:
    """A default value as JSON, the way a catalog, a setting or a payload would write it."""
    try:
        return json.dumps(v, sort_keys=True)
    except TypeError:
        return str(v)


GENERATED = ("!!! note \"Generated from the code\"\n"
             "    This page is rendered by `{module}` each time the site is built; edit the "
             "code, not the page.\n")


def banner(module: str) -> str:
    return GENERATED.format(module=module) + "\n"


def slug(heading: str) -> str:
    """The id Python-Markdown's `toc` extension gives a heading (its default `slugify`)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)
