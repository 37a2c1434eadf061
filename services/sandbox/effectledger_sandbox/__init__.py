"""The sandbox provider: an in-memory, payments-style HTTP API with injectable faults.

It stands in for real providers in demos, end-to-end tests, crash tests and benchmarks, and
keeps a ground truth (`GET /_truth`) of what was really applied, whatever clients were told.
"""

from .app import create_app, sandbox_state
from .responses import ConnectionDropped
from .server import main, serve
from .state import SandboxState

__all__ = ["ConnectionDropped", "SandboxState", "create_app", "main", "sandbox_state", "serve"]
