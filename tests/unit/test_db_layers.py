"""The ledger's `db` package stays flat: the transition applier stands on the schema, the rows,
the common helpers, the outbox and the statement executor (`hot`) only, never on the
group-commit engine or the modules that use it (read from the source, lazy imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import effectledger_ledger.db

DB_DIR = Path(effectledger_ledger.db.__file__).parent

# What each foundation module of `db` may import from `db`, and nothing else.
ALLOWED = {
    "transitions": {"schema", "rows", "common", "outbox", "hot"},
    "outbox": {"schema", "rows", "common", "calls"},
    "calls": set(),
    "common": {"schema", "rows", "hot"},
    "rows": set(),
    "schema": set(),
}


def db_imports(module: str) -> set[str]:
    """The `db` modules that `module` imports, at any depth in the file."""
    path = DB_DIR / f"{module}.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1 and node.module:  # from .x import y
            found.add(node.module.split(".")[0])
        elif node.level == 1:  # from . import x
            found.update(alias.name for alias in node.names)
        elif node.module and node.module.startswith("effectledger_ledger.db."):
            found.add(node.module.split(".")[2])
    return found


def test_the_reader_sees_relative_imports() -> None:
    assert db_imports("batch") >= {"calls", "store"}
    assert "hot" in db_imports("common")


def test_foundation_modules_import_only_what_they_stand_on() -> None:
    offenders = {m: sorted(db_imports(m) - allowed) for m, allowed in ALLOWED.items()
                 if db_imports(m) - allowed}
    assert offenders == {}, f"imports beyond the foundation: {offenders}"
