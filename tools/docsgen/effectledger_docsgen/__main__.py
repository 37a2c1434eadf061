"""`python -m effectledger_docsgen DIR`: write the generated reference pages under DIR."""

from __future__ import annotations

import sys
from pathlib import Path

from .pages import PAGES


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m effectledger_docsgen DIR", file=sys.stderr)
        return 2
    root = Path(argv[0])
    for uri, render in PAGES.items():
        target = root / uri
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render())
        print(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
