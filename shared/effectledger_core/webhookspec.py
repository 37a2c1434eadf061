"""Provider-native webhooks as the catalog declares them: `[webhooks.<provider>]`.

Pure data and checks; verification lives with the webhook ingress (the reconciler). Secrets are
never in the catalog: each entry of `secrets` must be a `${NAME}` reference, resolved by the
process that receives webhooks. Several secrets may be active at once (rotation).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .jsonpaths import check_path

PROVIDER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
ENV_ONLY = re.compile(r"^\$\{[A-Z_][A-Z0-9_]*\}$")
HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")
Scheme = Literal["standard", "stripe", "github", "hmac_header"]
EventMeaning = Literal["applied", "not_applied", "ignore"]


class WebhookProvider(BaseModel):
    """How one provider signs its webhooks and how its events name their operation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    scheme: Scheme = "standard"
    secrets: Annotated[list[str], Field(min_length=1, max_length=8)]
    # Seconds a signed timestamp may differ from our clock, both ways (standard and stripe).
    tolerance_s: Annotated[float, Field(gt=0, le=86400)] = 300.0
    # hmac_header only: where the signature is and how it is written.
    header: str | None = None
    algorithm: Literal["sha1", "sha256", "sha512"] = "sha256"
    encoding: Literal["base64", "hex"] = "base64"
    prefix: str = ""  # e.g. "sha256=" when the header value carries one
    # The delivery's unique id (deduplication): a header, or a JSONPath into the body.
    event_id_header: str | None = None
    event_id_path: str | None = None
    event_type_header: str | None = None
    event_type_path: str | None = None
    # Which event types mean what; an unlisted type is acknowledged and not used.
    events: dict[str, EventMeaning] = Field(default_factory=dict)
    # How an event finds its operation: a field carrying the operation key (metadata the
    # request set from {operation_key}), or the provider's reference of the effect.
    operation_key_path: str | None = None
    provider_ref_path: str | None = None
    # Where the event says which attempt (epoch) it is about, for providers that echo the
    # Fencing-Token: a "not applied" then speaks only for that epoch.
    fencing_token_path: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not PROVIDER_NAME.match(v):
            raise ValueError(f"must match {PROVIDER_NAME.pattern}")
        return v

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, v: list[str]) -> list[str]:
        for s in v:
            if not ENV_ONLY.match(s):
                raise ValueError("each secret must be a ${NAME} environment reference; "
                                 "secrets never live in the catalog")
        return v

    @field_validator("header", "event_id_header", "event_type_header")
    @classmethod
    def _header(cls, v: str | None) -> str | None:
        if v is not None and not HEADER_NAME.match(v):
            raise ValueError("must be an HTTP header name")
        return v.lower() if v is not None else None

    @field_validator("event_id_path", "event_type_path", "operation_key_path",
                     "provider_ref_path", "fencing_token_path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return check_path(v) if v is not None else None

    @model_validator(mode="after")
    def _consistent(self) -> WebhookProvider:
        if self.scheme == "hmac_header" and not self.header:
            raise ValueError("scheme 'hmac_header' needs 'header' (the signature's header)")
        if self.scheme != "hmac_header" and (self.header or self.prefix):
            raise ValueError("'header' and 'prefix' apply to scheme 'hmac_header' only")
        if self.operation_key_path is None and self.provider_ref_path is None:
            raise ValueError("set 'operation_key_path' or 'provider_ref_path' (or both): how "
                             "an event finds its operation")
        if not self.events:
            raise ValueError("'events' must map at least one event type to applied, "
                             "not_applied or ignore")
        return self

    def id_source(self) -> tuple[Literal["header", "path"], str]:
        """Where the event id is, with each scheme's documented default."""
        if self.event_id_header:
            return "header", self.event_id_header
        if self.event_id_path:
            return "path", self.event_id_path
        default = {"standard": ("header", "webhook-id"), "stripe": ("path", "$.id"),
                   "github": ("header", "x-github-delivery")}.get(self.scheme)
        if default is None:
            raise ValueError("no event id source")
        return default  # type: ignore[return-value]

    def type_source(self) -> tuple[Literal["header", "path"], str]:
        if self.event_type_header:
            return "header", self.event_type_header
        if self.event_type_path:
            return "path", self.event_type_path
        if self.scheme == "github":
            return "header", "x-github-event"
        return "path", "$.type"

    @model_validator(mode="after")
    def _sources(self) -> WebhookProvider:
        if self.scheme == "hmac_header" and not (self.event_id_header or self.event_id_path):
            raise ValueError("scheme 'hmac_header' needs 'event_id_header' or 'event_id_path'")
        return self
