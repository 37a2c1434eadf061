"""Under `effectledger up`, each child's environment holds what its role uses, read from
`/proc/<pid>/environ`: the API tokens and the database URL reach the ledger alone, provider
keys the dispatcher and reconciler, webhook secrets the reconciler, and nats-server gets no
effectledger setting at all. A secret in the user's shell that no role uses reaches no child.

On the old `up` (every child got the user's environment minus a few known names) the ledger's
tokens, the database URL and the shell's secrets were in every child's, nats-server included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.support.upproc import lines_until, stop_and_check, up_args, up_ports

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/environ")]
SHELL_SECRET = "shell-secret-no-role-uses"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in raw if "=" in item)


def _role(cmdline: list[str]) -> str:
    if cmdline and cmdline[0].endswith("nats-server"):
        return "nats-server"
    return cmdline[3] if len(cmdline) > 3 and cmdline[1:3] == ["-m", "effectledger_cli"] \
        else " ".join(cmdline)


def test_each_child_gets_only_what_its_role_uses(
        tmp_path: Path, running_up: list[subprocess.Popen[str]]) -> None:
    ports = up_ports()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EFFECTLEDGER_")}
    env.update({"CLOUD_SECRET_ACCESS_KEY": SHELL_SECRET,  # no role uses it
                "EFFECTLEDGER_TOKEN": SHELL_SECRET,  # a client's token: no service reads it
                "EFFECTLEDGER_NATS_PASSWORD": SHELL_SECRET,  # `up` gives each child its own
                "EFFECTLEDGER_LOG_LEVEL": "INFO",  # every Python service reads it
                "EFFECTLEDGER_DISPATCHER_CONCURRENCY": "7",  # the dispatcher's own
                "LC_ALL": "C.UTF-8"})
    proc = subprocess.Popen(up_args(tmp_path, ports, "--demo", "3"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    running_up.append(proc)
    lines = lines_until(proc, "demo:", 120)
    assert lines[-1] == 'demo: {"succeeded": 3}', lines  # the allow lists are complete

    data = tmp_path / "data"
    database = str(data / "ledger.db")
    environs: dict[str, dict[str, str]] = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        environs[_role(child.cmdline())] = _environ(child.pid)
    assert set(environs) == {"nats-server", "ledger", "dispatcher", "reconciler", "sandbox"}, \
        list(environs)

    def holders(secret: str) -> set[str]:
        return {role for role, e in environs.items() if any(secret in v for v in e.values())}

    def named(name: str) -> set[str]:
        return {role for role, e in environs.items() if name in e}

    assert holders(SHELL_SECRET) == set()
    assert holders(database) == {"ledger"}
    tokens = [(data / "nats-auth" / f).read_text().strip()
              for f in ("api-operator.token", "api-agent-default.token")]
    assert all(holders(t) == {"ledger"} for t in tokens)
    assert named("EFFECTLEDGER_DATABASE_URL") == {"ledger"}
    assert named("EFFECTLEDGER_AGENT_TOKENS") == named("EFFECTLEDGER_OPERATOR_TOKENS") == \
        {"ledger"}
    assert named("EFFECTLEDGER_SANDBOX_API_KEY") == {"dispatcher", "reconciler", "sandbox"}
    assert named("EFFECTLEDGER_WEBHOOK_SECRETS") == {"reconciler"}
    assert named("EFFECTLEDGER_SANDBOX_WEBHOOK_SECRET") == {"sandbox"}
    assert named("EFFECTLEDGER_DISPATCHER_CONCURRENCY") == {"dispatcher"}
    assert named("EFFECTLEDGER_LOG_LEVEL") == {"ledger", "dispatcher", "reconciler", "sandbox"}
    nats = environs["nats-server"]
    assert not [k for k in nats if k.startswith("EFFECTLEDGER_")], sorted(nats)
    assert set(nats) <= {"PATH", "PYTHONPATH", "VIRTUAL_ENV", "HOME", "LANG", "TMPDIR", "TZ",
                         "USER", "LOGNAME", "LC_ALL"}, sorted(nats)
    assert all(e.get("LC_ALL") == "C.UTF-8" and "PATH" in e for e in environs.values())
    stop_and_check(proc, signal.SIGTERM, list(ports.values()))
