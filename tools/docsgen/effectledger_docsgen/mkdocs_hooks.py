"""MkDocs hooks (`hooks:` in mkdocs.yml): the generated reference pages, and links to source.

- `on_files` adds every page of `pages.PAGES`, rendered from the code at build time.
- `on_page_markdown`: the design and catalog pages link to source files (`../shared/…`), which
  are outside the site. Each such link is checked against the repository (a missing file is a
  warning, so `mkdocs build --strict` fails) and shown as its text, since the site has no
  source browser to send a reader to.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

from effectledger_docsgen.pages import PAGES

log = logging.getLogger("mkdocs.hooks.effectledger_docsgen")

LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]+)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def on_files(files: Files, config: Any) -> Files:
    for uri, render in PAGES.items():
        files.append(File.generated(config, uri, content=render()))
    return files


def _outside(target: str, page_dir: Path, docs: Path) -> Path | None:
    """The repository file a relative link names, when it lies outside docs/."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
        return None  # a URL or an absolute path: MkDocs' own validation handles those
    resolved = (page_dir / target).resolve()
    if resolved == docs or docs in resolved.parents:
        return None
    return resolved


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    page_dir = (docs / page.file.src_uri).parent
    out: list[str] = []
    in_fence = False

    def rewrite(m: re.Match[str]) -> str:
        path = _outside(m["target"], page_dir, docs)
        if path is None:
            return m[0]
        if repo not in path.parents or not path.exists():
            log.warning("%s links to %s, which is not in the repository",
                        page.file.src_uri, m["target"])
        return m["text"]

    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            in_fence = not in_fence
        out.append(line if in_fence else LINK.sub(rewrite, line))
    return "".join(out)
