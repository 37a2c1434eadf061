"""Standard Webhooks verification: `webhook-id`, `webhook-timestamp`, `webhook-signature`.

The signature is `v1,<base64 HMAC-SHA256(secret, "<id>.<timestamp>.<body>")>`; the header may
carry several, space-separated. The HMAC itself is computed by the `standardwebhooks` package
(`Webhook.sign`); this module adds what its `verify()` cannot do for a service:
- the timestamp tolerance is checked against an injected clock (the library reads the wall
  clock and fixes the tolerance at five minutes), in both directions;
- several active secrets per provider, so a secret can be rotated without dropping deliveries;
- strict parsing: a malformed header is a clear rejection, never an exception, and the number
  of signatures looked at is bounded;
- every comparison is constant-time (`hmac.compare_digest`).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from standardwebhooks import Webhook

from effectledger_core.errors import ConfigError
from effectledger_core.ids import Clock, utcnow
from effectledger_core.limits import MAX_IDENTIFIER_BYTES

PROVIDER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
_PRINTABLE = re.compile(r"^[\x21-\x7e]+$")
MAX_SIGNATURES = 16  # bounds the HMACs one request can make us compute


class WebhookRejected(Exception):
    """A delivery that must not be used: answered with `status` and a stable `code`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Verified:
    webhook_id: str
    signed_at: datetime
    verified: bool = True  # False only under the unsafe test switch


def load_secret(provider: str, secret: str) -> Webhook:
    """A signer for one secret; a malformed secret is a configuration error naming the provider.

    Stricter than the library, which silently drops characters outside the base64 alphabet:
    `whsec_` + base64 of 16..64 bytes, so a typo fails the deployment instead of every delivery.
    """
    body = secret.removeprefix("whsec_")
    try:
        raw = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except ValueError:
        raw = b""
    if not secret.startswith("whsec_") or not 16 <= len(raw) <= 64:
        # Never echo the secret itself.
        raise ConfigError(f"webhook secret for provider {provider!r} is not a valid Standard "
                          f"Webhooks secret (whsec_ + base64 of 16..64 bytes)",
                          provider=provider)
    return Webhook(raw)


class WebhookVerifier:
    def __init__(self, secrets: Mapping[str, Sequence[str]], *, tolerance_s: float = 300.0,
                 clock: Clock = utcnow, skip_verification: bool = False) -> None:
        self._signers: dict[str, list[Webhook]] = {}
        for provider, values in secrets.items():
            if not PROVIDER_NAME.match(provider):
                raise ConfigError(f"webhook provider name {provider!r} must match "
                                  f"{PROVIDER_NAME.pattern}", provider=provider)
            signers = [load_secret(provider, v) for v in values]
            if signers:
                self._signers[provider] = signers
        self.tolerance_s = tolerance_s
        self.clock = clock
        self.skip_verification = skip_verification

    @property
    def providers(self) -> list[str]:
        return sorted(self._signers)

    def check_provider(self, provider: str) -> None:
        """Raise 404 unless deliveries from `provider` can be verified (cheap; no body needed)."""
        if provider in self._signers or (self.skip_verification
                                         and PROVIDER_NAME.match(provider)):
            return
        raise WebhookRejected(404, "unknown_provider",
                              f"no webhook secrets are configured for {provider[:64]!r}")

    def verify(self, provider: str, headers: Mapping[str, str], body: bytes) -> Verified:
        """Check one delivery; raises WebhookRejected with the reason if it must not be used.

        `headers` must be case-insensitive or lower-case (Starlette's are).
        """
        self.check_provider(provider)
        signers = self._signers.get(provider, [])
        webhook_id = headers.get("webhook-id") or ""
        if not webhook_id or len(webhook_id.encode()) > MAX_IDENTIFIER_BYTES \
                or not _PRINTABLE.match(webhook_id):
            raise WebhookRejected(400, "invalid_webhook_id",
                                  "webhook-id must be 1..1024 printable ASCII characters")
        if self.skip_verification:
            return Verified(webhook_id, self._timestamp_or_now(headers), verified=False)
        raw_ts, raw_sig = headers.get("webhook-timestamp"), headers.get("webhook-signature")
        if not raw_ts or not raw_sig:
            raise WebhookRejected(401, "missing_signature",
                                  "webhook-timestamp and webhook-signature are required")
        if not _TIMESTAMP.match(raw_ts):
            raise WebhookRejected(400, "invalid_timestamp",
                                  "webhook-timestamp must be integer seconds since the epoch")
        signed_at = _instant(raw_ts)
        if signed_at is None:
            # Past datetime's range (253402300800 is the year 10000): out of any tolerance.
            raise WebhookRejected(401, "timestamp_in_future",
                                  "webhook-timestamp is outside any tolerance")
        skew = (signed_at - self.clock()).total_seconds()
        if skew < -self.tolerance_s:
            raise WebhookRejected(401, "timestamp_too_old",
                                  f"signed {-skew:.0f}s ago; tolerance {self.tolerance_s:g}s")
        if skew > self.tolerance_s:
            raise WebhookRejected(401, "timestamp_in_future",
                                  f"signed {skew:.0f}s ahead; tolerance {self.tolerance_s:g}s")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WebhookRejected(400, "invalid_body", "the body is not UTF-8") from exc
        given = _signatures(raw_sig)
        if not given:
            raise WebhookRejected(401, "invalid_signature", "no v1 signature in the header")
        matched = False
        for signer in signers:
            expected = base64.b64decode(signer.sign(webhook_id, signed_at, text).split(",", 1)[1])
            for candidate in given:
                # Keep comparing after a match: the time taken must not depend on which matched.
                matched |= hmac.compare_digest(expected, candidate)
        if not matched:
            raise WebhookRejected(401, "invalid_signature",
                                  "no signature matches any active secret")
        return Verified(webhook_id, signed_at)

    def _timestamp_or_now(self, headers: Mapping[str, str]) -> datetime:
        raw = headers.get("webhook-timestamp") or ""
        if _TIMESTAMP.match(raw):
            return _instant(raw) or self.clock()
        return self.clock()


def _instant(raw: str) -> datetime | None:
    """Integer seconds since the epoch as a UTC instant; None when no datetime can hold it."""
    try:
        return datetime.fromtimestamp(int(raw), tz=UTC)
    except (OverflowError, OSError, ValueError):
        return None


def _signatures(header: str) -> list[bytes]:
    """The decoded `v1` signatures of a `webhook-signature` header (others are ignored)."""
    out: list[bytes] = []
    for part in header.split(" ")[:MAX_SIGNATURES]:
        version, sep, value = part.partition(",")
        if version != "v1" or not sep:
            continue
        try:
            decoded = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(decoded) == 32:  # an HMAC-SHA256; anything else cannot match
            out.append(decoded)
    return out
