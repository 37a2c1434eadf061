"""The ledger service: the only writer of the ledger database."""
