"""The CLI finds the tools through the `effectledger.commands` entry points, and runs without
them: a missing tool is left out, a broken one is reported, never hidden."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from effectledger_cli import commands
from effectledger_cli.main import build_parser, main

EP = importlib.metadata.EntryPoint


def ep(name: str, value: str) -> importlib.metadata.EntryPoint:
    return EP(name=name, value=value, group=commands.GROUP)


@pytest.fixture
def fake_tool() -> Iterator[types.ModuleType]:
    module = types.ModuleType("fake_effectledger_tool")
    module.HELP = "a fake tool"  # type: ignore[attr-defined]
    calls: list[argparse.Namespace] = []

    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--n", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        calls.append(args)
        return 7

    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_the_installed_tools_are_registered_as_entry_points() -> None:
    names = {e.name: e.value for e in importlib.metadata.entry_points(group=commands.GROUP)}
    assert names == {"bench": "effectledger_bench.cli", "chaos": "effectledger_chaos.cli",
                     "bench-agent": "effectledger_bench.agentwait"}
    assert set(commands.discover()) == {"bench", "bench-agent", "chaos"}


def test_a_tool_whose_module_is_not_installed_is_left_out() -> None:
    found = commands.discover([ep("ghost", "effectledger_no_such_tool.cli"),
                               ep("ghost2", "effectledger_bench.no_such_module")])
    assert found == {}


def test_a_tool_that_fails_on_its_own_missing_dependency_is_listed_as_unavailable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken_effectledger_tool.py").write_text(
        "import effectledger_dependency_that_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [ep("broken", "broken_effectledger_tool")])
    try:
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert "broken" in sub.choices  # listed, not hidden
        assert parser.parse_args(["ledger"]).command == "ledger"  # the services still start
        assert main(["broken", "--anything"]) == 2
    finally:
        sys.modules.pop("broken_effectledger_tool", None)
    err = capsys.readouterr().err
    assert "cannot load" in err and "effectledger_dependency_that_is_missing" in err


def test_a_module_without_the_command_interface_is_unavailable(
        capsys: pytest.CaptureFixture[str]) -> None:
    found = commands.discover([ep("json", "json"), ep("dumps", "json:dumps")])
    assert found["json"].help.startswith("(unavailable: BrokenCommand")
    assert "must name a module" in found["dumps"].help
    assert found["json"].run(argparse.Namespace()) == 2
    assert "HELP (str), add_arguments(parser) and run(args)" in capsys.readouterr().err


def test_a_tool_cannot_replace_a_built_in_command(fake_tool: types.ModuleType) -> None:
    with pytest.raises(commands.BrokenCommand, match="built-in"):
        commands.discover([ep("ledger", fake_tool.__name__)], reserved=frozenset({"ledger"}))


def test_a_discovered_tool_becomes_a_subcommand_that_main_runs(
        fake_tool: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [ep("fake", fake_tool.__name__)])
    assert main(["fake", "--n", "3"]) == 7
    [args] = fake_tool.calls  # type: ignore[attr-defined]
    assert args.n == 3


def test_without_tools_the_cli_lists_no_tool_and_still_parses_the_services(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [ep("bench", "effectledger_no_such_tool.cli")])
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "bench" not in sub.choices and "chaos" not in sub.choices
    assert parser.parse_args(["ledger", "--port", "1"]).ledger_port == 1


def test_building_the_cli_loads_no_command_s_heavy_dependencies() -> None:
    """Every service starts through this parser, so whatever a subcommand's module imports at
    its top stays in each service's memory: the MCP SDK and httpx (`mcp`, `bench-agent`) cost
    a ledger about 25 MiB. A fresh interpreter, since this one may have loaded them already."""
    heavy = ["mcp", "httpx", "effectledger_client", "effectledger_mcp.server",
             "effectledger_bench.stack"]
    probe = ("import sys\n"
             "from effectledger_cli.main import build_parser\n"
             "build_parser()\n"
             f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
