"""`python -m effectledger_sandbox --port N --api-key K`."""

from .server import main

raise SystemExit(main())
