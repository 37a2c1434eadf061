"""No import cycles inside any package of the house (the product's and the tools'), lazy
imports included: a cycle hidden by an import inside a function is still a cycle (read from
the source). Each package is checked on its own modules; its subpackages are packages of their
own here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The source folders on the path (pyproject.toml's packages): shared/<pkg>, services/*/<pkg>,
# tools/*/<pkg>.
TOP = [*ROOT.glob("shared/effectledger_*"), *ROOT.glob("services/*/effectledger_*"),
       *ROOT.glob("tools/*/effectledger_*")]


def packages() -> dict[str, Path]:
    """Every package and subpackage under the source folders, by dotted name."""
    out: dict[str, Path] = {}
    for top in TOP:
        for init in sorted(top.rglob("__init__.py")):
            parts = init.parent.relative_to(top.parent).parts
            out[".".join(parts)] = init.parent
    return out


PACKAGES = packages()


def imports(package: str, root: Path) -> dict[str, set[str]]:
    """Each module of the package (not its subpackages) to the package modules it imports."""
    modules = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        path = root / f"{name}.py"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith(package + "."):
                found.add(node.module.removeprefix(package + ".").split(".")[0])
        graph[name] = found & modules
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def test_the_cycle_finder_finds_a_lazy_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_every_package_is_checked() -> None:
    """The folders were found: the product's packages and the tools' (bench, chaos) among them."""
    assert {"effectledger_core", "effectledger_ledger.db", "effectledger_reconciler",
            "effectledger_bench", "effectledger_chaos"} <= set(PACKAGES)


def test_the_reader_sees_the_deciders() -> None:
    graph = imports("effectledger_reconciler", PACKAGES["effectledger_reconciler"])
    assert {"audit", "decisions"} <= graph["strategy"]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle(package: str) -> None:
    assert cycle(imports(package, PACKAGES[package])) is None
