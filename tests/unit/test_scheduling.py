"""The heavy tests run on one worker under `pytest -n 2` (tests/support/scheduling.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import HEAVY_MODULES
from tests.support.scheduling import group_of

ROOT = Path(__file__).resolve().parents[2]


def test_a_test_of_a_listed_module_is_in_the_group_and_any_other_alone() -> None:
    modules = {"tests/e2e/test_chaos_ci.py"}
    assert group_of("tests/e2e/test_chaos_ci.py::test_x[1]", modules, "g") == "g"
    assert group_of("tests/e2e/test_chaos_ci.py::test_x[1]@g", modules, "g") == "g"
    assert group_of("tests/e2e/test_pipeline.py::test_y", modules, "g") \
        == "tests/e2e/test_pipeline.py::test_y"


def test_every_listed_module_exists() -> None:
    """A renamed module would silently leave the group."""
    assert all((ROOT / m).is_file() for m in HEAVY_MODULES), HEAVY_MODULES


def test_two_workers_run_the_whole_group_on_one_of_them(tmp_path: Path) -> None:
    """A small suite under `-n 2`: its grouped tests (two modules, three each) all report the
    same worker. With xdist's own loadgroup on pytest 9.2 they were spread over both."""
    (tmp_path / "conftest.py").write_text(
        "from tests.support.scheduling import ModuleGroups\n"
        "def pytest_xdist_make_scheduler(config, log):\n"
        "    return ModuleGroups(config, log, {'test_a.py', 'test_b.py'}, 'g')\n")
    body = ("import os, pytest\n"
            "@pytest.mark.parametrize('i', range({n}))\n"
            "def test_it(i):\n"
            "    with open('ran.txt', 'a') as f:\n"
            "        f.write('{name} ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n")
    for name, n in (("a", 3), ("b", 3), ("c", 12)):
        (tmp_path / f"test_{name}.py").write_text(body.format(n=n, name=name))
    # Only xdist: the other installed plugins take most of a worker's start-up.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-n", "2", "-q",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    assert len(ran) == 18
    grouped = {worker for name, worker in ran if name in ("a", "b")}
    assert len(grouped) == 1, ran
