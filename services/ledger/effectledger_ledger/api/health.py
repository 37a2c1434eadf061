"""Probes and metrics, unauthenticated: liveness (`/healthz`: the process answers HTTP at
all), readiness split in two (`/readyz`: intents are accepted; `/readyz/relay`: commands and
outcomes move), and the Prometheus scrape."""

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from effectledger_core.views import Health, Readiness
from effectledger_obs.http import metrics_response

from ..auth import OPEN_API_WARNING
from .deps import ApiState, State

INTENTS_NEED = ("database",)
RELAY_NEEDS = ("database", "nats", "relay")

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(state: State) -> Response:
    # Unauthenticated like /healthz: scrapers carry no token, and the figures hold no
    # operation ids, tenants or arguments (bounded labels only).
    if state.before_scrape is not None:
        await state.before_scrape()  # the gauges read from the database (gauges.py)
    return metrics_response()


@router.get("/healthz", responses={200: {"model": Health}})
async def healthz() -> Health:
    return Health(ok=True)


async def readiness(state: ApiState, need: tuple[str, ...]) -> JSONResponse:
    checks = await state.ready()
    missing = [name for name, v in checks.items() if isinstance(v, bool) and not v]
    ok = not any(name in missing for name in need)
    return JSONResponse({"ok": ok, "checks": checks, "missing": missing,
                         "accepting_intents": not any(n in missing for n in INTENTS_NEED),
                         "relaying": not any(n in missing for n in RELAY_NEEDS),
                         "auth": "enabled" if state.authenticator.enabled else "disabled",
                         "warnings": ([] if state.authenticator.enabled
                                      else [OPEN_API_WARNING])},
                        status_code=200 if ok else 503)


@router.get("/readyz", responses={200: {"model": Readiness}, 503: {"model": Readiness}})
async def readyz(state: State) -> JSONResponse:
    """Ready to accept intents, approvals and reads: the database answers. A missing
    broker is named in `missing` but does not make the ledger unready: commands wait in
    the outbox and the relay publishes them once NATS is back."""
    return await readiness(state, INTENTS_NEED)


@router.get("/readyz/relay", responses={200: {"model": Readiness}, 503: {"model": Readiness}})
async def readyz_relay(state: State) -> JSONResponse:
    """Ready to move commands and outcomes: database, NATS and the relay all running."""
    return await readiness(state, RELAY_NEEDS)
