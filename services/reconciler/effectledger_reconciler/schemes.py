"""Provider-native webhook signature schemes, as each provider documents them.

- `standard` (Standard Webhooks, also Svix): `webhook-id`, `webhook-timestamp`,
  `webhook-signature: v1,<base64>`; verified by the `standardwebhooks` library through
  `signatures.WebhookVerifier` (tolerance from an injected clock, rotation, bounded parsing).
- `stripe`: `Stripe-Signature: t=<unix seconds>,v1=<hex>[,v1=<hex>…]`, each v1 being
  HMAC-SHA256(secret, "<t>.<raw body>") in hex; the timestamp must be within the tolerance.
- `github`: `X-Hub-Signature-256: sha256=<hex>` = HMAC-SHA256(secret, raw body); no timestamp
  (replays are harmless: the ledger deduplicates by the `X-GitHub-Delivery` id).
- `hmac_header`: a configured header holding HMAC-<algorithm>(secret, raw body) in base64 or
  hex, after an optional prefix (Shopify: `X-Shopify-Hmac-Sha256`, base64).

Every check runs over the raw bytes, tries each active secret (rotation), compares with
`hmac.compare_digest` and keeps comparing after a match so timing does not say which matched.
No third-party library implements Stripe's or GitHub's scheme without pulling in their SDKs,
so those are written from the providers' documented algorithm.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from effectledger_core.ids import Clock
from effectledger_core.webhookspec import WebhookProvider

from .signatures import MAX_SIGNATURES, Verified, WebhookRejected, WebhookVerifier

_DIGESTS = {"sha1": hashlib.sha1, "sha256": hashlib.sha256, "sha512": hashlib.sha512}
_HEX = re.compile(r"^[0-9a-fA-F]+$")
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
MAX_SIGNATURE_HEADER = 4096


def _mac(secret: str, message: bytes, algorithm: str = "sha256") -> bytes:
    return hmac.new(secret.encode(), message, _DIGESTS[algorithm]).digest()


def _any_match(expected: Sequence[bytes], given: Sequence[bytes]) -> bool:
    matched = False
    for e in expected:
        for g in given:
            matched |= hmac.compare_digest(e, g)
    return matched


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name) or ""
    if not value:
        raise WebhookRejected(401, "missing_signature", f"the {name} header is required")
    if len(value) > MAX_SIGNATURE_HEADER:
        raise WebhookRejected(400, "invalid_signature", f"the {name} header is too long")
    return value


def _check_time(signed_at: datetime, now: datetime, tolerance_s: float) -> None:
    skew = (signed_at - now).total_seconds()
    if skew < -tolerance_s:
        raise WebhookRejected(401, "timestamp_too_old",
                              f"signed {-skew:.0f}s ago; tolerance {tolerance_s:g}s")
    if skew > tolerance_s:
        raise WebhookRejected(401, "timestamp_in_future",
                              f"signed {skew:.0f}s ahead; tolerance {tolerance_s:g}s")


def verify_stripe(secrets: Sequence[str], headers: Mapping[str, str], body: bytes, *,
                  now: datetime, tolerance_s: float) -> datetime:
    """Stripe's documented scheme; returns the signed time."""
    raw = _header(headers, "stripe-signature")
    timestamp: str | None = None
    given: list[bytes] = []
    for item in raw.split(",")[:MAX_SIGNATURES * 2]:
        key, sep, value = item.strip().partition("=")
        if not sep:
            continue
        if key == "t":
            timestamp = value
        elif key == "v1" and _HEX.match(value) and len(value) == 64:
            given.append(bytes.fromhex(value))
    if timestamp is None or not _TIMESTAMP.match(timestamp):
        raise WebhookRejected(400, "invalid_timestamp", "Stripe-Signature has no valid t=")
    if not given:
        raise WebhookRejected(401, "invalid_signature", "Stripe-Signature has no v1 signature")
    try:
        signed_at = datetime.fromtimestamp(int(timestamp), tz=UTC)
    except (OverflowError, OSError, ValueError):  # past datetime's range: a 401, not a 500
        raise WebhookRejected(401, "timestamp_in_future",
                              "Stripe-Signature t= is outside any tolerance") from None
    _check_time(signed_at, now, tolerance_s)
    expected = [_mac(s, timestamp.encode() + b"." + body) for s in secrets]
    if not _any_match(expected, given):
        raise WebhookRejected(401, "invalid_signature", "no signature matches any active secret")
    return signed_at


def verify_github(secrets: Sequence[str], headers: Mapping[str, str], body: bytes) -> None:
    raw = _header(headers, "x-hub-signature-256")
    value = raw.removeprefix("sha256=")
    if value == raw or not _HEX.match(value) or len(value) != 64:
        raise WebhookRejected(401, "invalid_signature",
                              "X-Hub-Signature-256 must be sha256=<64 hex digits>")
    if not _any_match([_mac(s, body) for s in secrets], [bytes.fromhex(value)]):
        raise WebhookRejected(401, "invalid_signature", "no signature matches any active secret")


def verify_hmac_header(spec: WebhookProvider, secrets: Sequence[str],
                       headers: Mapping[str, str], body: bytes) -> None:
    assert spec.header is not None  # the catalog requires it for this scheme
    raw = _header(headers, spec.header)
    value = raw.removeprefix(spec.prefix) if spec.prefix else raw
    if spec.prefix and value == raw:
        raise WebhookRejected(401, "invalid_signature",
                              f"{spec.header} must start with {spec.prefix!r}")
    try:
        given = (base64.b64decode(value, validate=True) if spec.encoding == "base64"
                 else bytes.fromhex(value))
    except (binascii.Error, ValueError) as exc:
        raise WebhookRejected(401, "invalid_signature",
                              f"{spec.header} is not {spec.encoding}") from exc
    expected = [_mac(s, body, spec.algorithm) for s in secrets]
    if not _any_match(expected, [given]):
        raise WebhookRejected(401, "invalid_signature", "no signature matches any active secret")


class SchemeVerifier:
    """Verifies deliveries for one catalog-declared provider with its resolved secrets."""

    def __init__(self, spec: WebhookProvider, secrets: Sequence[str], clock: Clock) -> None:
        if not secrets:
            raise ValueError(f"webhook provider {spec.name!r} has no secrets")
        self.spec = spec
        self.secrets = list(secrets)
        self.clock = clock
        self._standard = (WebhookVerifier({spec.name: self.secrets},
                                          tolerance_s=spec.tolerance_s, clock=clock)
                          if spec.scheme == "standard" else None)

    def verify(self, headers: Mapping[str, str], body: bytes) -> Verified:
        """Check the signature; the webhook id is filled in later from the event (see native)."""
        now = self.clock()
        scheme = self.spec.scheme
        if self._standard is not None:
            return self._standard.verify(self.spec.name, headers, body)
        if scheme == "stripe":
            signed_at = verify_stripe(self.secrets, headers, body, now=now,
                                      tolerance_s=self.spec.tolerance_s)
            return Verified("", signed_at)
        if scheme == "github":
            verify_github(self.secrets, headers, body)
        else:
            verify_hmac_header(self.spec, self.secrets, headers, body)
        return Verified("", now)
