"""What the Docker image installs runs every service, and nothing of the tools comes with it.

The test reads `infra/Dockerfile`, lays out in a temporary folder exactly what its `COPY`
instructions take from the build context (with Docker's rules: a directory source copies its
contents), `pip install`s that folder into a fresh virtual environment (pip's configured index or
wheel cache; no Docker needed), and runs `effectledger ledger|dispatcher|reconciler --help`.
"""

from __future__ import annotations

import glob
import json
import os
import posixpath
import shlex
import shutil
import subprocess
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "infra" / "Dockerfile"
SERVICES = ("ledger", "dispatcher", "reconciler")
TOOL_PACKAGES = ("effectledger_bench", "effectledger_chaos", "effectledger_testkit")


@dataclass(frozen=True)
class Copy:
    stage: int
    sources: tuple[str, ...]  # relative to the build context
    dest: str  # absolute, in the image


def _instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuations joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment line inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    if pending:
        lines.append(pending)
    out = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def _arguments(rest: str) -> tuple[list[str], list[str]]:
    """(flags, operands) of a COPY: the JSON form or the shell-like form."""
    words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
    flags = [w for w in words if w.startswith("--")]
    return flags, [w for w in words if not w.startswith("--")]


def copies_from_context(text: str) -> list[Copy]:
    """Every `COPY` that takes files from the build context (not `--from` another stage or
    image), with its destination made absolute against the stage's WORKDIR."""
    stage, workdir = -1, "/"
    found: list[Copy] = []
    for keyword, rest in _instructions(text):
        if keyword == "FROM":
            stage, workdir = stage + 1, "/"
        elif keyword == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, rest.strip().strip('"')))
        elif keyword in ("COPY", "ADD"):
            flags, operands = _arguments(rest)
            if any(f.startswith("--from") for f in flags) or len(operands) < 2:
                continue
            *sources, dest = operands
            absolute = posixpath.join(workdir, dest)
            # Keep the trailing slash: it says "into this directory".
            if dest.endswith("/") or dest in (".", "./"):
                absolute = posixpath.normpath(absolute) + "/"
            else:
                absolute = posixpath.normpath(absolute)
            found.append(Copy(stage, tuple(sources), absolute))
    return found


def _ignore(folder: str, names: list[str]) -> set[str]:
    # What a clean checkout would not have: caches and build output of a developer's tree.
    return {n for n in names if n == "__pycache__" or n.endswith((".egg-info", ".pyc"))}


def lay_out(copies: list[Copy], context: Path, image_root: Path) -> None:
    """Apply `copies` to `image_root` as Docker would (a directory source copies its contents;
    several sources or a trailing slash mean the destination is a directory)."""
    for copy in copies:
        matches: list[Path] = []
        for source in copy.sources:
            hits = sorted(glob.glob(str(context / source)))
            if not hits:
                raise FileNotFoundError(f"COPY source {source!r} is not in the build context")
            matches += [Path(h) for h in hits]
        dest = image_root / copy.dest.lstrip("/")
        into_dir = copy.dest.endswith("/") or len(matches) > 1
        for src in matches:
            if src.is_dir():
                shutil.copytree(src, dest, ignore=_ignore, dirs_exist_ok=True)
            else:
                target = dest / src.name if into_dir else dest
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)


def install_root(copies: list[Copy], image_root: Path) -> Path:
    """The folder the image installs from: where pyproject.toml landed."""
    found = sorted(image_root.rglob("pyproject.toml"))
    if not found:
        raise AssertionError("no COPY brings pyproject.toml into the image")
    return found[0].parent


# -- the parser, on a multi-stage Dockerfile like the one the deployment is moving to -----------

MULTI_STAGE = """\
# syntax=docker/dockerfile:1
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY --chown=1000:1000 shared ./shared
COPY ["services", "services/"]
RUN pip wheel --no-deps -w /wheels . \\
    && echo done
FROM python:3.11-slim
WORKDIR /app
COPY --from=build /wheels /wheels
COPY infra/catalog.compose.toml \\
     /etc/effectledger/catalog.toml
"""


def test_the_parser_reads_every_copy_from_the_build_context() -> None:
    assert copies_from_context(MULTI_STAGE) == [
        Copy(0, ("pyproject.toml", "README.md"), "/src/"),
        Copy(0, ("shared",), "/src/shared"),
        Copy(0, ("services",), "/src/services/"),
        Copy(1, ("infra/catalog.compose.toml",), "/etc/effectledger/catalog.toml"),
    ]


def test_the_layout_follows_dockers_rules(tmp_path: Path) -> None:
    context = tmp_path / "context"
    (context / "pkg" / "a").mkdir(parents=True)
    (context / "pkg" / "a" / "x.py").write_text("x = 1\n")
    (context / "pkg" / "__pycache__").mkdir()
    (context / "one.toml").write_text("")
    (context / "two.md").write_text("")
    image = tmp_path / "image"
    lay_out([Copy(0, ("one.toml", "two.md"), "/app/"), Copy(0, ("pkg",), "/app/pkg"),
             Copy(0, ("one.toml",), "/etc/renamed.toml")], context, image)
    assert (image / "app" / "one.toml").exists() and (image / "app" / "two.md").exists()
    assert (image / "app" / "pkg" / "a" / "x.py").exists()  # contents, not the folder itself
    assert not (image / "app" / "pkg" / "__pycache__").exists()
    assert (image / "etc" / "renamed.toml").is_file()
    with pytest.raises(FileNotFoundError, match="missing"):
        lay_out([Copy(0, ("missing",), "/app/")], context, image)


def test_the_dockerfile_leaves_the_tools_out() -> None:
    copied = {s.split("/")[0] for c in copies_from_context(DOCKERFILE.read_text())
              for s in c.sources}
    assert "tools" not in copied and "." not in copied, copied


# -- the install itself --------------------------------------------------------------------------

def _clean_env(venv_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv_dir)
    return env


@pytest.mark.slow
def test_an_install_of_what_the_image_copies_runs_every_service(tmp_path: Path) -> None:
    copies = copies_from_context(DOCKERFILE.read_text())
    image = tmp_path / "image"
    lay_out(copies, REPO, image)
    source = install_root(copies, image)
    assert not (source / "tools").exists()

    venv_dir = tmp_path / "venv"
    venv.create(venv_dir, with_pip=True, clear=True)
    env = _clean_env(venv_dir)
    python = str(venv_dir / "bin" / "python")
    run_dir = tmp_path / "elsewhere"  # not the repository: nothing importable from the cwd
    run_dir.mkdir()
    pip = subprocess.run([python, "-m", "pip", "install", "--quiet", str(source)], env=env,
                         cwd=run_dir, capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]

    cli = str(venv_dir / "bin" / "effectledger")
    for service in SERVICES:
        out = subprocess.run([cli, service, "--help"], env=env, cwd=run_dir,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"effectledger {service} --help:\n{out.stderr[-3000:]}"
        assert f"usage: effectledger {service}" in out.stdout

    overview = subprocess.run([cli, "--help"], env=env, cwd=run_dir, capture_output=True,
                              text=True, timeout=120)
    assert overview.returncode == 0, overview.stderr[-3000:]
    assert "bench" not in overview.stdout and "chaos" not in overview.stdout

    probe = ("import importlib.util, json; print(json.dumps({n: importlib.util.find_spec(n) "
             f"is not None for n in {TOOL_PACKAGES!r}}}))")
    found = subprocess.run([python, "-c", probe], env=env, cwd=run_dir, capture_output=True,
                           text=True, timeout=120, check=True)
    assert json.loads(found.stdout) == dict.fromkeys(TOOL_PACKAGES, False)

    missing = subprocess.run([cli, "bench", "--quick"], env=env, cwd=run_dir,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "invalid choice: 'bench'" in missing.stderr
    assert "Traceback" not in missing.stderr

