"""The console's pages, one module-level router per group, in the order they are matched:
sign-in, overview, operations, approvals, reviews and the pipeline."""

from . import approvals, operations, overview, pipeline, reviews, signin

ROUTERS = (signin.router, overview.router, operations.router, approvals.router,
           reviews.router, pipeline.router)
