"""The settings reference: every `EFFECTLEDGER_*` variable, read from `Settings` (its fields,
defaults and bounds) and the comments beside each field."""

from __future__ import annotations

from .catalog import field_comments, model_table
from .md import banner


def _is_heading(comment: str) -> bool:
    """`# storage`, `# nats`: a comment naming the group of fields below it, not a meaning."""
    return bool(comment) and comment == comment.lower() and len(comment.split()) <= 3 \
        and not comment.endswith(".")


def render() -> str:
    from effectledger_core.config import DEMO_CATALOG, Settings

    prefix = str(Settings.model_config.get("env_prefix", ""))
    notes = {name: ("" if _is_heading(text) else text)
             for name, text in field_comments(Settings).items()}
    table = model_table(Settings, notes=notes, rename=lambda name: prefix + name.upper(),
                        first="variable")
    # The demo catalog's default is a path inside the installed package, not the builder's.
    table = table.replace(str(DEMO_CATALOG), f"<the package>/{DEMO_CATALOG.parent.name}/"
                          f"{DEMO_CATALOG.name}")
    return "\n".join([
        "# Every setting\n", banner("effectledger_docsgen.settings"),
        f"Every variable the services read (`{prefix}<NAME>`; a command-line flag overrides "
        "its variable), with its type, default and bounds. What the main ones are for, with "
        "examples: [configuration](configuration.md).\n", table])
