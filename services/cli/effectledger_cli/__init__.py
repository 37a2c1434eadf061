"""The `effectledger` command line."""
