"""The reconciler service: resolves ambiguous outcomes by evidence, never by a guess.

- `strategy`: the pure decisions (readback, webhook wait, review) from a tool's capabilities;
- `worker`: the durable JetStream consumer of `<prefix>.reconcile.v1.>` that carries them out;
- `ledger_client`: the read-only `rpc_operation` request-reply to the ledger;
- `signatures`, `webhooks`: Standard Webhooks verification and `POST /v1/webhooks/{provider}`;
- `app`: the composition root (`serve`).
"""
