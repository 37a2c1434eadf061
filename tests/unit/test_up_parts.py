"""The parts of `effectledger up` and of the services' start-up that need no process."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pydantic
import pytest
import sqlalchemy

from effectledger_cli.children import PortTaken, check_ports
from effectledger_cli.startup_errors import startup_error_line
from effectledger_cli.up_plan import demo_catalog_text, merged_webhook_secrets
from effectledger_core.catalog import Catalog
from effectledger_core.config import Settings


def test_the_users_webhook_secrets_are_kept_and_the_runs_secret_added() -> None:
    mine = json.dumps({"stripe": ["whsec_a"], "sandbox": ["whsec_old"]})
    merged = json.loads(merged_webhook_secrets(mine, "sandbox", "whsec_new"))
    assert merged == {"stripe": ["whsec_a"], "sandbox": ["whsec_old", "whsec_new"]}
    assert json.loads(merged_webhook_secrets(None, "sandbox", "whsec_n")) == {
        "sandbox": ["whsec_n"]}


@pytest.mark.parametrize("bad", ["{not json", '["whsec_a"]', '{"p": "whsec_a"}'])
def test_malformed_user_webhook_secrets_are_refused_in_one_line(bad: str) -> None:
    with pytest.raises(ValueError, match="EFFECTLEDGER_WEBHOOK_SECRETS") as info:
        merged_webhook_secrets(bad, "sandbox", "whsec_x")
    assert "\n" not in str(info.value)


def test_the_demo_catalog_follows_the_sandbox_port(tmp_path: Path) -> None:
    path = tmp_path / "demo.toml"
    path.write_text(demo_catalog_text(18777))
    catalog = Catalog.load(path)
    endpoints = [t.endpoint for t in catalog.tools.values()]
    assert endpoints and all(e.startswith("http://127.0.0.1:18777/") for e in endpoints)
    assert "8700" not in path.read_text()


def test_a_taken_port_is_named_with_its_holder_in_one_line() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(PortTaken) as info:
            check_ports({"ledger": (port, "--ledger-port")})
    message = str(info.value)
    assert f"port {port} (ledger) is in use by pid {os.getpid()}" in message
    assert "--ledger-port" in message and "\n" not in message


def _settings_error(**env: str) -> pydantic.ValidationError:
    with pytest.raises(pydantic.ValidationError) as info:
        Settings(**env)  # type: ignore[arg-type]
    return info.value


def test_a_bad_log_level_is_one_line_naming_the_variable() -> None:
    line = startup_error_line(_settings_error(log_level="LOUD"))
    assert line is not None and "EFFECTLEDGER_LOG_LEVEL" in line and "'LOUD'" in line


def test_a_bad_setting_is_one_line_naming_the_variable() -> None:
    line = startup_error_line(_settings_error(ledger_port="abc"))
    assert line is not None and "EFFECTLEDGER_LEDGER_PORT" in line and "\n" not in line


def test_database_url_problems_are_one_line() -> None:
    with pytest.raises(sqlalchemy.exc.ArgumentError) as parse:
        sqlalchemy.make_url("nonsense")
    assert "EFFECTLEDGER_DATABASE_URL" in (startup_error_line(parse.value) or "")
    refused = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 1)")
    assert "not reachable" in (startup_error_line(refused) or "")


def test_an_unknown_error_keeps_its_traceback() -> None:
    assert startup_error_line(KeyError("bug")) is None


def test_a_json_setting_that_does_not_parse_is_one_line_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pydantic_settings

    monkeypatch.setenv("EFFECTLEDGER_WEBHOOK_SECRETS", "{bad")
    with pytest.raises(pydantic_settings.SettingsError) as info:
        Settings()
    line = startup_error_line(info.value)
    assert line is not None and line.startswith(
        "invalid setting EFFECTLEDGER_WEBHOOK_SECRETS: cannot parse its value")


@pytest.mark.parametrize("flag", ["--ledger-port", "--sandbox-port", "--reconciler-port"])
def test_up_refuses_a_port_out_of_range_before_anything(flag: str, tmp_path: Path) -> None:
    from effectledger_cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", flag, "70000"])
    from effectledger_cli.up_plan import Refused, plan

    args = build_parser().parse_args(["up", "--data-dir", str(tmp_path), "--ledgers", "3",
                                      "--ledger-port", "65534", "--database-url",
                                      "postgresql+asyncpg://x/y"])
    with pytest.raises(Refused, match="no such port: ledger 3 65536"):
        plan(args)


def test_the_image_health_check_probes_the_service_the_container_runs(tmp_path: Path) -> None:
    from effectledger_cli import healthcheck

    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"/opt/effectledger/bin/python\0/opt/effectledger/bin/effectledger\0"
                        b"reconciler\0--host\0000.0.0.0\0--port\0008811\0")
    argv = healthcheck.main_command(cmdline)
    assert healthcheck.service_of(argv) == "reconciler"
    assert healthcheck.endpoint("reconciler", {}, argv) == "http://127.0.0.1:8811/healthz"
    assert healthcheck.endpoint("ledger", {"EFFECTLEDGER_LEDGER_PORT": "9000"},
                                ["effectledger", "ledger"]) == "http://127.0.0.1:9000/healthz"
    assert healthcheck.endpoint("dispatcher", {}, ["effectledger", "dispatcher"]) is None
    assert healthcheck.service_of(["effectledger", "migrate"]) is None  # one-shot: passes


def test_the_image_health_check_passes_on_200_and_fails_on_a_refused_port(tmp_path: Path) -> None:
    import http.server
    import threading

    from effectledger_cli import healthcheck

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cmdline = tmp_path / "cmdline"
    try:
        cmdline.write_bytes(f"effectledger\0sandbox\0--port\0{server.server_port}\0".encode())
        assert healthcheck.main([], cmdline=cmdline) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert healthcheck.main([], cmdline=cmdline) == 1  # nothing listens there any more
