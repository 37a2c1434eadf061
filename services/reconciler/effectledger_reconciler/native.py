"""Provider-native webhooks declared in the catalog (`[webhooks.<provider>]`).

A delivery is verified by its provider's scheme (schemes.py) before its body is read as an
event. Then the catalog entry says where the event id and type are, what the type means
(applied / not_applied / ignore; unlisted types are ignored) and how the event finds its
operation (a JSONPath to the operation key the request carried, e.g. metadata set from
`{operation_key}`, and/or to the provider's reference). The result is the same verified
`WebhookReceived` evidence the ledger already applies; which tools it may speak for is the
ledger's check (`Catalog.webhook_tools`), so a provider's webhook never decides another
provider's tool.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from effectledger_core.catalog import Catalog
from effectledger_core.errors import ConfigError
from effectledger_core.ids import Clock, utcnow
from effectledger_core.jsonpaths import find_first, scalar_text
from effectledger_core.limits import MAX_IDENTIFIER_BYTES
from effectledger_core.messages import WebhookReceived
from effectledger_core.webhookspec import ENV_ONLY, WebhookProvider

from .schemes import SchemeVerifier
from .signatures import WebhookRejected


def resolve_secrets(spec: WebhookProvider, env: Mapping[str, str]) -> list[str]:
    """The provider's secrets from the environment; a missing one fails the deployment."""
    out = []
    for ref in spec.secrets:
        assert ENV_ONLY.match(ref)
        name = ref[2:-1]
        value = env.get(name, "")
        if not value:
            raise ConfigError(f"webhook provider {spec.name!r}: environment variable {name} "
                              f"is not set", provider=spec.name)
        out.append(value)
    return out


def _text(value: Any, what: str, limit: int = MAX_IDENTIFIER_BYTES) -> str | None:
    text = scalar_text(value)
    if text is not None and len(text.encode()) > limit:
        raise WebhookRejected(422, "invalid_event", f"{what} is longer than {limit} bytes")
    return text


class NativeWebhooks:
    def __init__(self, verifiers: Mapping[str, SchemeVerifier]) -> None:
        self.verifiers = dict(verifiers)

    @classmethod
    def from_catalog(cls, catalog: Catalog, env: Mapping[str, str],
                     clock: Clock = utcnow) -> NativeWebhooks:
        return cls({name: SchemeVerifier(spec, resolve_secrets(spec, env), clock)
                    for name, spec in catalog.webhooks.items()})

    @property
    def providers(self) -> list[str]:
        return sorted(self.verifiers)

    def __contains__(self, provider: object) -> bool:
        return provider in self.verifiers

    def message(self, provider: str, headers: Mapping[str, str], body: bytes,
                received_at: datetime) -> WebhookReceived | None:
        """Verify and read one delivery; None if its event type is to be ignored.

        Raises WebhookRejected for anything that must not be used (signature, time, shape).
        """
        verifier = self.verifiers[provider]
        spec = verifier.spec
        verified = verifier.verify(headers, body)  # before the body is trusted in any way
        try:
            event: Any = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise WebhookRejected(400, "invalid_json", "the body is not JSON") from exc
        where, source = spec.type_source()
        event_type = _text(headers.get(source) if where == "header" else
                           find_first(event, source), "the event type", 200)
        if event_type is None:
            raise WebhookRejected(400, "invalid_event", f"no event type at {source}")
        meaning = spec.events.get(event_type, "ignore")
        where, source = spec.id_source()
        webhook_id = verified.webhook_id or _text(
            headers.get(source) if where == "header" else find_first(event, source),
            "the event id")
        if not webhook_id:
            raise WebhookRejected(400, "invalid_webhook_id", f"no event id at {source}")
        if meaning == "ignore":
            return None
        key = (_text(find_first(event, spec.operation_key_path), "the operation key")
               if spec.operation_key_path else None)
        ref = (_text(find_first(event, spec.provider_ref_path), "the provider reference")
               if spec.provider_ref_path else None)
        token = (find_first(event, spec.fencing_token_path) if spec.fencing_token_path
                 else None)
        if isinstance(token, bool) or not isinstance(token, int):
            token = None  # absent or not an epoch: the ledger falls back to arrival time
        if key is None and ref is None:
            raise WebhookRejected(422, "unmatched_event",
                                  "the event carries neither an operation key nor a provider "
                                  "reference at the configured paths")
        try:
            return WebhookReceived(
                provider=provider, webhook_id=webhook_id, event_type=event_type,
                operation_key=key, provider_ref=ref, outcome=meaning,
                # A provider's "failed" event is its last word on that effect.
                final=meaning == "not_applied", fencing_token=token,
                body_digest="sha256:" + hashlib.sha256(body).hexdigest(),
                signed_at=verified.signed_at, received_at=received_at)
        except ValidationError as exc:
            fields = ", ".join(".".join(str(p) for p in e["loc"]) for e in exc.errors()[:5])
            raise WebhookRejected(422, "invalid_event", f"out of bounds: {fields}") from exc
