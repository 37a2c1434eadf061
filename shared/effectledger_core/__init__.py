"""effectledger's pure core: states, transitions, identities, messages, catalog and errors.

Nothing in this package performs I/O; adapters in the service packages wrap it.
"""
