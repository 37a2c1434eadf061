"""Keeping the `heavy` tests on one worker under `pytest -n 2`, whatever pytest's version.

`--dist loadgroup` sends tests with the same `xdist_group` mark to one worker by appending
`@<group>` to each test's node id on the worker. On pytest 9.2 that assignment no longer
reaches the node id (pytest keeps a structured id now), so the marks are silently ignored:
the heavy tests ran on both workers at once, beside each other, and a module fixture shared by
a module's tests (the CI chaos run's three seeds) ran once on each worker (pytest-xdist#1386,
open when this was written). The controller only sees node ids, never marks, so the group is
read from the test's module path here; `tests/conftest.py` names the modules and fails the
collection when a module's marks and the list disagree.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from xdist.scheduler import LoadScopeScheduling


def group_of(nodeid: str, modules: Collection[str], group: str) -> str:
    """The scheduling unit of a test: `group` for a test in one of `modules` (rootdir-relative
    paths), else the test alone. A node id xdist did suffix (`…@heavy`, older pytest) has the
    same path, so both agree."""
    return group if nodeid.split("::", 1)[0] in modules else nodeid


class ModuleGroups(LoadScopeScheduling):
    """xdist's scope scheduler with the scope taken from `group_of`: the group is one unit of
    work, handed out first (xdist orders units by size), every other test is a unit alone."""

    def __init__(self, config: Any, log: Any, modules: Collection[str], group: str) -> None:
        super().__init__(config, log)
        self.modules = frozenset(modules)
        self.group = group

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid, self.modules, self.group)
