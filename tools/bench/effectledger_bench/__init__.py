"""Benchmarks: effectledger against the pgbench limit, DBOS and no durability (issue 6)."""
