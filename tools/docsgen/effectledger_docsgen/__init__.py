"""The documentation site's reference pages, rendered from the code at build time.

Each page is a pure function returning Markdown (`pages.PAGES`): the CLI from its argparse
parser, the HTTP API from the ledger's OpenAPI document, the messages from the AsyncAPI
document, the catalog's fields from its pydantic models, the metrics from their definitions
and the alerts from `infra/observability/alerts.yaml`. `mkdocs_hooks.py` adds them to the site
when `mkdocs build` runs, so the reference cannot drift from the code; `python -m
effectledger_docsgen DIR` writes them to a folder for reading without MkDocs.

A tool, not part of the product: nothing in shared/ or services/ imports it.
"""
