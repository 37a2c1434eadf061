"""What an `effectledger` process imports before its command runs.

Every process builds the whole CLI: each service, each `submit`, each `up`. Building it
imported nats-py, pydantic-settings, the MCP mapping and every installed tool (bench, chaos)
with their libraries: about 0.8 s on a 2-core VM before any command began, and a refused `up`
took 2.5 s under CI's load. These run in a fresh interpreter, where `sys.modules` says what
was imported."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.upproc import up_args, up_ports

# What a command's own module imports when it runs, never while the CLI is being built.
HEAVY = ("nats", "pydantic_settings", "sqlalchemy", "httpx", "aiohttp", "jsonschema",
         "effectledger_bench", "effectledger_chaos", "effectledger_bus.permissions",
         "effectledger_mcp.mapping", "mcp")


def imported_after(code: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def heavy_in(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY or m in HEAVY)


def test_building_the_cli_for_a_built_in_command_imports_nothing_heavy() -> None:
    for command in ("submit", "up", "ledger", "streams", "mcp", "nats-config", "deploy-env"):
        modules = imported_after("from effectledger_cli.main import build_parser\n"
                                 f"build_parser([{command!r}, '--help-not-parsed'])")
        assert not heavy_in(modules), (command, heavy_in(modules))


def test_the_tools_are_still_listed_when_no_built_in_command_is_named() -> None:
    from effectledger_cli.commands import discover
    from effectledger_cli.main import build_parser

    tools = set(discover())
    assert tools, "no tool command is installed: this test proves nothing here"
    parser = build_parser([])
    choices = next(a.choices for a in parser._actions if a.dest == "command")
    assert tools <= set(choices)
    # and a tool asked for by name is there to run
    bench = sorted(tools)[0]
    choices = next(a.choices for a in build_parser([bench])._actions if a.dest == "command")
    assert bench in choices


def test_a_refused_up_imports_neither_the_broker_nor_the_catalog(tmp_path: Path) -> None:
    ports = up_ports()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports["ledger"]))
        holder.listen()
        args = up_args(tmp_path, ports)[3:]  # after `python -m effectledger_cli`
        code = ("import sys\nfrom effectledger_cli.main import main\n"
                f"assert main({args!r}) == 1")
        modules = imported_after(code)
    assert not heavy_in(modules), heavy_in(modules)
    assert "effectledger_core.catalog" not in modules
