"""The reconciler service (provider readback, signed webhooks, human review).

Not built yet: it arrives with its own issue. Ambiguous outcomes wait, durably, on the
`<prefix>.reconcile.v1.ambiguous` subject of the events stream until it does.
"""
