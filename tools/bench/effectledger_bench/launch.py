"""Fallback service launcher: `python -m effectledger_bench.launch ledger|dispatcher|sandbox`.

It does what `effectledger <service>` does with no flags (settings from `EFFECTLEDGER_*`), and is
used only when `python -m effectledger_cli --help` itself fails (e.g. the CLI module is broken
mid-edit by an unrelated subcommand), so the benchmark still measures the services. The run's
results record which launcher was used.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str]) -> int:
    service = argv[0]
    if service == "sandbox":
        from effectledger_sandbox.server import main as sandbox_main

        return sandbox_main(argv[1:])
    from effectledger_core.config import Settings

    settings = Settings()
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if service == "ledger":
        from effectledger_ledger.app import serve
    elif service == "dispatcher":
        from effectledger_dispatcher.app import serve
    elif service == "reconciler":
        from effectledger_reconciler.app import serve
    else:
        print(f"unknown service {service!r}", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    from effectledger_cli.main import run_loop

    run_loop(serve(settings))  # the same loop as `effectledger <service>`
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
