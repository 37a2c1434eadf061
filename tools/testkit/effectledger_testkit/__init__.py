"""Helpers shared by the project's tools (the benchmark and the proving ground); not the product.

The services and the `effectledger` CLI never import this package: an install of only what the
Docker image copies does not contain it.
"""
