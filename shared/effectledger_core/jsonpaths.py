"""JSONPath into provider answers and webhook bodies (`jsonpath-ng`, extended syntax).

Paths are checked once at catalog load (`check_path`) and compiled once per process. A path
that leads nowhere gives no matches; it is never an error at read time.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from jsonpath_ng import JSONPath
from jsonpath_ng.ext.parser import parse as _parse

MAX_PATH_CHARS = 256


@lru_cache(maxsize=1024)
def _compiled(path: str) -> JSONPath:
    return _parse(path)


def check_path(path: str) -> str:
    """Return `path` if it is a JSONPath starting at the root (`$`); raise ValueError if not."""
    if not path.startswith("$") or len(path) > MAX_PATH_CHARS:
        raise ValueError(f"JSONPath {path!r} must start with '$' and be at most "
                         f"{MAX_PATH_CHARS} characters")
    try:
        _compiled(path)
    except Exception as exc:
        # jsonpath-ng raises its lexer and parser errors, and plain Exception for some other
        # syntax errors: all of them mean "invalid".
        raise ValueError(f"JSONPath {path!r} is invalid: {exc}") from exc
    return path


def find_all(value: Any, path: str) -> list[Any]:
    """Every value the path selects (in document order)."""
    return [m.value for m in _compiled(path).find(value)]


def find_first(value: Any, path: str) -> Any:
    """The first value the path selects, or None."""
    found = find_all(value, path)
    return found[0] if found else None


def scalar_text(value: Any) -> str | None:
    """A selected value as a reference string: strings and integers only, never empty."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    text = str(value)
    return text or None
