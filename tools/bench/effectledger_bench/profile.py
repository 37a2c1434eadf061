"""Where the time goes: py-spy samples of a service during load, summarised.

`py-spy record --format raw` writes collapsed stacks (`frame;frame;... count`). The summary
gives the share of samples by the package of the innermost frame (self time), the functions
with the most self time, and the share of samples that pass through a few frames of interest
(inclusive time), e.g. SQLAlchemy's execute or pydantic's validation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::\d+)?\)$")


def py_spy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    candidate = Path(sys.executable).parent / "py-spy"
    return str(candidate) if candidate.exists() else None


def start(pid: int, out: Path, seconds: float, rate: int = 67) -> subprocess.Popen[bytes] | None:
    exe = py_spy()
    if exe is None:
        return None
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(int(seconds)), "--gil",
                             "-r", str(rate), "--nonblocking", "-f", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def package_of(file: str) -> str:
    """py-spy names files by module path (`faststream/_internal/x.py`, `asyncio/events.py`,
    `selectors.py`): the first component is the package (or the stdlib module)."""
    if "site-packages/" in file:
        file = file.split("site-packages/", 1)[1]
    head = file.split("/", 1)[0]
    return head.removesuffix(".py") or file


INTEREST = {
    "sqlalchemy execute": ("sqlalchemy/", "execute"),
    "sqlalchemy compile": ("sqlalchemy/sql/compiler.py", ""),
    "asyncpg": ("asyncpg/", ""),
    "pydantic": ("pydantic", ""),
    "faststream": ("faststream/", ""),
    "nats-py": ("/nats/", ""),
    "json": ("json/", ""),
    "uvicorn/fastapi/starlette": ("starlette/", ""),
    "httpx": ("httpx/", ""),
    "httpcore/h11": ("httpcore/", ""),
    "aiohttp": ("aiohttp/", ""),  # the provider client since issue 17
    "tenacity": ("tenacity/", ""),
    "logging": ("logging/", ""),
}


def summarise(raw: Path, top: int = 12) -> dict[str, Any]:
    if not raw.exists():
        return {"error": "no profile written"}
    by_pkg: Counter[str] = Counter()
    by_func: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    idle = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = stack.split(";")
        leaf = frames[-1]
        m = _FRAME.match(leaf)
        func, file = (m.group("func"), m.group("file")) if m else (leaf, "")
        if "selectors" in file and func.endswith(("select", "poll")):
            idle += count  # waiting in the event loop's selector: not work
        total += count
        by_pkg[package_of(file)] += count
        by_func[f"{func} ({file.rsplit('/', 2)[-2] if '/' in file else ''}/"
                f"{file.rsplit('/', 1)[-1]})"] += count
        seen = set()
        for label, (path_part, func_part) in INTEREST.items():
            for fr in frames:
                if path_part in fr and func_part in fr and label not in seen:
                    seen.add(label)
                    inclusive[label] += count
                    break
    if total == 0:
        return {"error": "no samples"}

    def pct(c: Counter[str]) -> list[tuple[str, float]]:
        return [(k, round(100 * v / total, 1)) for k, v in c.most_common(top)]

    return {"samples": total, "idle_pct": round(100 * idle / total, 1),
            "self_by_package_pct": pct(by_pkg), "self_top_functions_pct": pct(by_func),
            "inclusive_pct": sorted(((k, round(100 * v / total, 1))
                                     for k, v in inclusive.items()), key=lambda kv: -kv[1])}
