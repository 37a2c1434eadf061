"""`python -m effectledger_bench` = `effectledger bench` (same flags)."""

from __future__ import annotations

import argparse
import sys

from .cli import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="effectledger bench", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
