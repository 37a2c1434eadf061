"""Fitness: the services drive SQLAlchemy and asyncpg through their public APIs only.

`db/hot.py` once reached into SQLAlchemy's asyncpg adapter and compiler (`_start_transaction`,
`_handle_exception`, `Pool._invalidate`, `_bind_processors`, `_returning`): names any minor
release may rename. In a module that imports SQLAlchemy or asyncpg, no attribute whose name
starts with one underscore may be read off anything but `self`/`cls` (a NamedTuple's own
`_replace`, `_asdict`, `_fields`, `_make` are public API), by dot or by `getattr`, and no
known private name of theirs may appear as a string.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [ROOT / "services", ROOT / "shared"]
DRIVERS = ("sqlalchemy", "asyncpg")
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
# Private names the hot path used, or would be tempted to (the adapter's and the pool's).
KNOWN_PRIVATE = {"_start_transaction", "_handle_exception", "_invalidate", "_bind_processors",
                 "_returning", "_post_values_clause", "_transaction", "_connection",
                 "_cached_bind_processor", "_asyncpg_error_translate", "_execute_mutex",
                 "_invalidate_time", "_dbapi_connection", "_proxied"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def _uses_a_driver(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(n.split(".")[0] in DRIVERS for n in names):
            return True
    return False


def private_uses(source: str) -> list[str]:
    """Every private attribute read in `source` (a module that imports a driver), as
    `line: name`."""
    tree = ast.parse(source)
    if not _uses_a_driver(tree):
        return []
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, node.col_offset, f".{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            found.append((node.lineno, node.col_offset,
                          f"{node.func.id}({node.args[1].value!r})"))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value in KNOWN_PRIVATE and not _is_getattr_name(tree, node)):
            found.append((node.lineno, node.col_offset, repr(node.value)))
    return [f"{line}: {what}" for line, _col, what in sorted(found)]


def _is_getattr_name(tree: ast.Module, constant: ast.Constant) -> bool:
    """Whether `constant` is the name argument of a getattr-like call (reported as that)."""
    return any(isinstance(n, ast.Call) and len(n.args) > 1 and n.args[1] is constant
               for n in ast.walk(tree))


def test_no_module_reads_a_private_attribute_of_sqlalchemy_or_asyncpg() -> None:
    offenders = {}
    for folder in SCANNED:
        for path in sorted(folder.rglob("*.py")):
            uses = private_uses(path.read_text())
            if uses:
                offenders[str(path.relative_to(ROOT))] = uses
    assert offenders == {}


def test_the_check_finds_what_the_old_hot_path_did() -> None:
    old = """
import sqlalchemy as sa

async def driver(conn, stmt, compiled, exc):
    raw = await conn.get_raw_connection()
    adapter = raw.dbapi_connection
    if getattr(adapter, "_transaction", None) is None:
        await adapter._start_transaction()
    adapter._handle_exception(exc)
    conn.sync_engine.pool._invalidate(raw, exc)
    bind = dict(compiled._bind_processors)
    return stmt._returning, sa.Row._mapping, self._fine, change._replace(a=1)
"""
    assert [u.split(": ")[1] for u in private_uses(old)] == [
        "getattr('_transaction')", "._start_transaction", "._handle_exception", "._invalidate",
        "._bind_processors", "._returning", "._mapping"]
    # The same code in a module that imports neither driver is not this test's business.
    assert private_uses(old.replace("import sqlalchemy as sa", "import json")) == []
