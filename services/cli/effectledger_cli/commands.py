"""Subcommands found at run time: the tools (`effectledger bench`, `effectledger chaos`) live
outside the product and register through the `effectledger.commands` entry-point group.

An entry point names a module with `HELP` (one line), `add_arguments(parser)` and
`run(args) -> int`. The product never imports a tool by name: an install of only the services
(the Docker image) still carries the entry points in its metadata, but their modules are absent,
so a command whose own module cannot be found is left out of the CLI. Any other failure while
loading it is a bug in that tool: the command stays listed as unavailable and, when run, prints
the error and exits 2. It is never hidden, and it never stops the services from starting.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import importlib.metadata

GROUP = "effectledger.commands"


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # An unavailable command takes any arguments, so that running it reports why it cannot
    # load rather than an argparse complaint about its flags.
    any_arguments: bool = False


class BrokenCommand(Exception):
    """A registered command that cannot be used (its module does not offer what a command
    needs, or it would replace a built-in command)."""


def _missing_module(exc: ModuleNotFoundError, module: str) -> bool:
    """True when `exc` says the entry point's own module (or a parent package) is absent, not
    that something it imports is."""
    missing = exc.name or ""
    return missing != "" and (module == missing or module.startswith(missing + "."))


def _from_module(name: str, module: ModuleType) -> Command:
    help_ = getattr(module, "HELP", None)
    add = getattr(module, "add_arguments", None)
    run = getattr(module, "run", None)
    if not isinstance(help_, str) or not callable(add) or not callable(run):
        raise BrokenCommand(f"entry point {GROUP}:{name} ({module.__name__}) must define "
                            "HELP (str), add_arguments(parser) and run(args) -> int")
    return Command(name, help_, add, run)


def _unavailable(name: str, error: str) -> Command:
    def add_arguments(p: argparse.ArgumentParser) -> None:
        pass

    def run(args: argparse.Namespace) -> int:
        print(f"effectledger {name}: this command is installed but cannot load: {error}",
              file=sys.stderr)
        return 2

    return Command(name, f"(unavailable: {error[:120]})", add_arguments, run,
                   any_arguments=True)


def discover(entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
             reserved: frozenset[str] = frozenset()) -> dict[str, Command]:
    """The installed tool commands by name; names in `reserved` (built-ins) are refused."""
    if entry_points is None:
        import importlib.metadata

        entry_points = importlib.metadata.entry_points(group=GROUP)
    found: dict[str, Command] = {}
    for ep in sorted(entry_points, key=lambda e: e.name):
        if ep.name in reserved:
            raise BrokenCommand(f"entry point {GROUP}:{ep.name} would replace a built-in "
                                "command")
        if ep.name in found:
            continue  # the same distribution seen twice on sys.path (an editable install)
        try:
            found[ep.name] = _load(ep)
        except ModuleNotFoundError as exc:
            if _missing_module(exc, ep.module):
                continue  # the tool is not installed here
            found[ep.name] = _unavailable(ep.name, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # any bug in a tool's import must not stop the services
            found[ep.name] = _unavailable(ep.name, f"{type(exc).__name__}: {exc}")
    return found


def _load(ep: importlib.metadata.EntryPoint) -> Command:
    loaded = ep.load()
    if not isinstance(loaded, ModuleType):
        raise BrokenCommand(f"entry point {GROUP}:{ep.name} must name a module, "
                            f"not {ep.value!r}")
    return _from_module(ep.name, loaded)
