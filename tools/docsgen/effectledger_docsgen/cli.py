"""The CLI reference: every `effectledger` command and option, read from its argparse parser."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from .md import banner, code, prose, slug, table

WIDTH = 96  # usage lines are wrapped here, not at the width of whoever builds the site


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str,
                                                                    argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:  # argparse's own expansion, e.g. "(default: %(default)s)"
        text = text % {**vars(action), "prog": prog}
    return text


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(code(o) for o in action.option_strings) or code(action.dest)
        if action.choices is not None and not isinstance(action.choices, dict):
            names += " " + code("{" + ",".join(str(c) for c in action.choices) + "}")
        default = action.default
        hidden = default is None or default is False or default == argparse.SUPPRESS
        shown = "" if hidden or action.required else str(default)
        rows.append((names, prose(_help(action, parser.prog)), code(shown) if shown else ""))
    return rows


def _section(name: str, summary: str, parser: argparse.ArgumentParser, depth: int) -> list[str]:
    out = [f"{'#' * depth} `{name}`\n"]
    if summary:
        out.append(prose(summary.rstrip(".")) + ".\n")
    out.append("```text\n" + _usage(parser) + "\n```\n")
    rows = _options(parser)
    if rows:
        out.append(table(["option", "meaning", "default"], rows))
    for sub_name, sub_help, sub in _subcommands(parser):
        out += _section(f"{name} {sub_name}", sub_help, sub, min(depth + 1, 4))
    return out


def render(parser: argparse.ArgumentParser | None = None) -> str:
    if parser is None:
        from effectledger_cli.main import build_parser

        parser = build_parser()
    commands = list(_subcommands(parser))
    out = ["# CLI reference\n", banner("effectledger_docsgen.cli"),
           "Every command takes `--help`. Settings come from `EFFECTLEDGER_*` environment "
           "variables ([configuration](configuration.md)); a flag overrides its variable.\n",
           table(["command", "what it does"],
                 [(f"[`{n}`](#{slug('effectledger ' + n)})", prose(h)) for n, h, _ in commands])]
    for name, summary, sub in commands:
        out += _section(f"effectledger {name}", summary, sub, 2)
    return "\n".join(out)

