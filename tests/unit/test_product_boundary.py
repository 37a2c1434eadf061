"""The product (shared/, services/) never imports the tools (tools/) or the tests: the Docker
image installs only the product, and an import of a tool would break every service there."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = (REPO / "shared", REPO / "services")
TOOLS_AND_TESTS = frozenset({"effectledger_bench", "effectledger_chaos", "effectledger_testkit",
                             "effectledger_docsgen", "tests"})


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_tool_packages_live_under_tools_only() -> None:
    for name in TOOLS_AND_TESTS - {"tests"}:
        homes = [p.relative_to(REPO).as_posix() for p in REPO.glob(f"*/*/{name}")]
        homes += [p.relative_to(REPO).as_posix() for p in REPO.glob(f"*/{name}")]
        assert homes and all(h.startswith("tools/") for h in homes), (name, homes)


def test_no_product_module_imports_a_tool_or_a_test_helper() -> None:
    offenders = {}
    files = [f for root in PRODUCT for f in root.rglob("*.py")]
    assert len(files) > 50  # the walk found the product
    for f in files:
        bad = imported_roots(f) & TOOLS_AND_TESTS
        if bad:
            offenders[f.relative_to(REPO).as_posix()] = sorted(bad)
    assert offenders == {}


def test_the_walk_would_see_a_lazy_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def run():\n    from effectledger_bench.cli import run\n")
    assert "effectledger_bench" in imported_roots(f)
