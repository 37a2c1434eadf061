"""`effectledger_core` is the pure core: none of its modules imports an I/O library, directly
(read from the source) or through what it imports (seen in a fresh interpreter)."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import effectledger_core

# Libraries that do I/O: databases, the broker, HTTP clients and servers. The core decides;
# adapters around it do the talking. None of them may be loaded, even through a dependency.
IO_LIBRARIES = frozenset({
    "sqlalchemy", "asyncpg", "aiosqlite", "psycopg", "psycopg2", "alembic",
    "nats", "faststream",
    "httpx", "httpcore", "h11", "requests", "urllib3", "aiohttp",
    "fastapi", "starlette", "uvicorn", "anyio", "uvloop", "standardwebhooks",
})
# The standard library's networking and process modules: never imported by a core module
# itself (pydantic and tenacity load some of them for their own reasons, so only direct
# imports are checked).
IO_STDLIB = frozenset({"asyncio", "socket", "selectors", "ssl", "http", "urllib", "smtplib",
                       "subprocess"})
# Stdlib modules with a narrow use, named so a new use is a decision, not an accident.
ALLOWED = {
    ("effectledger_core.config", "socket"): "socket.gethostname() for default service ids",
    ("effectledger_core.urltemplate", "urllib"): "urllib.parse: quote and urlsplit on strings",
}
CORE_DIR = Path(effectledger_core.__file__).parent


def core_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(CORE_DIR)], "effectledger_core."))


def direct_imports(module: str, root: Path = CORE_DIR) -> set[str]:
    path = root / (module.removeprefix("effectledger_core.").replace(".", "/") + ".py")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_walk_sees_the_core_modules() -> None:
    modules = core_modules()
    assert {"effectledger_core.states", "effectledger_core.unsafe",
            "effectledger_core.messages"} <= set(modules)


def test_no_core_module_imports_an_io_library() -> None:
    offenders = {m: sorted(bad) for m in core_modules()
                 if (bad := {lib for lib in direct_imports(m) & (IO_LIBRARIES | IO_STDLIB)
                             if (m, lib) not in ALLOWED})}
    assert offenders == {}


def test_importing_the_whole_core_loads_no_io_library() -> None:
    code = ("import importlib, json, sys\n"
            f"for m in {core_modules()!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    loaded = set(json.loads(out.stdout))
    assert "effectledger_core" in loaded
    assert sorted(loaded & IO_LIBRARIES) == []


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("import json\nfrom sqlalchemy import text\n\n"
                                   "def f():\n    import httpx.x\n    from . import y\n")
    assert direct_imports("effectledger_core.m", tmp_path) == {"json", "sqlalchemy", "httpx"}
