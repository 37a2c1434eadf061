"""The tool catalog: a TOML file declaring each tool's provider call and contract.

Secrets never live in the file: header values and URLs may reference environment variables as
`${NAME}`, resolved only by the processes that call the provider (dispatcher, reconciler).
Invalid catalogs fail at load with a message naming the tool and the field. `docs/catalog.md`
describes every field.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import urltemplate
from .digest import digest
from .errors import CatalogError, UnknownTool
from .identical import DEFAULT_DEDUPE_WINDOW_S
from .jsonpaths import check_path
from .results import MAX_RESULT_BYTES, MAX_RESULT_BYTES_CAP, check_result_path
from .urltemplate import KNOWN, TemplateError, TemplateSyntaxError
from .webhookspec import WebhookProvider

__all__ = ["Catalog", "EffectClass", "TemplateError", "Tool", "render", "resolve_env",
           "tool_input_schema"]

TOOL_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
ENV_REF = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)\}")
PLACEHOLDER = re.compile(r"\{(operation_key|operation_id|epoch|args(?:\.[A-Za-z0-9_]+)+)\}")


class EffectClass(StrEnum):
    READ_ONLY = "read_only"
    IDEMPOTENT = "idempotent"
    REVERSIBLE = "reversible"
    COMPENSATABLE = "compensatable"
    NON_IDEMPOTENT = "non_idempotent"
    UNKNOWN = "unknown"


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Capabilities(_Strict):
    accepts_idempotency_key: bool = False
    readback: bool = False
    webhooks: bool = False
    fencing_token: bool = False
    async_acceptance: bool = False


class FoundWhen(_Strict):
    """How a readback answer says "found": a status code, or a JSON path that is non-empty."""

    status: int | None = None
    json_path: str | None = None

    @model_validator(mode="after")
    def _one_rule(self) -> FoundWhen:
        if (self.status is None) == (self.json_path is None):
            raise ValueError("set exactly one of 'status' or 'json_path'")
        return self


class Readback(_Strict):
    url: str
    method: Literal["GET"] = "GET"
    found_when: FoundWhen = FoundWhen(status=200)
    not_found_status: int = 404
    # JSONPath to the provider's reference of the effect (e.g. `$.data[0].id` in a search).
    ref_path: str | None = None
    # JSONPath selecting every effect the answer lists for this key (e.g. `$.data[*]`): more
    # than one means the provider applied the request more than once (`duplicate_detected`).
    count_path: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        try:
            urltemplate.parse(v, allow_epoch=False)
        except TemplateSyntaxError as exc:
            raise ValueError(str(exc)) from exc
        return v

    @field_validator("ref_path", "count_path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return check_path(v) if v is not None else None


class Tool(_Strict):
    """One catalog entry (docs/catalog.md)."""

    name: str
    endpoint: str
    method: Literal["POST", "PUT", "PATCH", "DELETE", "GET"] = "POST"
    body_encoding: Literal["json", "form"] = "json"
    # Maps the request body; values may be templates. Absent: the arguments are the body.
    body: dict[str, Any] | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    idempotency_header: str | None = "Idempotency-Key"
    fencing_header: str | None = "Fencing-Token"
    effect_class: EffectClass = EffectClass.UNKNOWN
    contract_revision: Annotated[str, Field(min_length=1, max_length=64)]
    capabilities: Capabilities = Capabilities()
    readback: Readback | None = None
    timeout_s: Annotated[float, Field(gt=0, le=300)] = 10.0
    max_attempts: Annotated[int, Field(ge=1, le=100)] = 3
    # Provider processing horizon: after it, a readback that finds nothing means "not applied".
    # More than 0: the send deadline is a fraction of it (effectledger_core/send_deadline.py).
    horizon_s: Annotated[float, Field(gt=0, le=86400)] = 5.0
    # Automatic retries stop once this much time has passed since the intent was accepted.
    retry_deadline_s: Annotated[float, Field(gt=0, le=30 * 86400)] = 3600.0
    # How long a key-less identical call (same tenant, task, tool, arguments) joins an earlier
    # operation that succeeded, for intents that ask for it (identical.py). 0: never.
    dedupe_window_s: Annotated[float, Field(ge=0, le=30 * 86400)] = DEFAULT_DEDUPE_WINDOW_S
    # The provider's answer kept for the agent (results.py): at most this many bytes (as JSON;
    # 0 keeps none), and with `result_path` (JSONPath) only the part a model needs.
    max_result_bytes: Annotated[int, Field(ge=0, le=MAX_RESULT_BYTES_CAP)] = MAX_RESULT_BYTES
    result_path: str | None = None
    commit_policy: Literal["auto", "approval"] = "auto"
    adapter: str | None = None  # "package.module:Factory" for providers TOML cannot express
    description: str = ""
    # A short human title (MCP's tool title); empty: derived from the name.
    title: Annotated[str, Field(max_length=120)] = ""
    # Whether the effect can be undone without a trace outside: "undoable" (a ticket can be
    # closed), "irreversible" (money moved, a message sent). Unset: "undoable" for the
    # `reversible` effect class, else "irreversible". Agents' hosts read it as destructiveHint
    # (docs/agents.md, "Annotations").
    reversibility: Literal["undoable", "irreversible"] | None = None
    # JSON Schema (draft 2020-12) for the arguments, checked at admission. Absent: one derived
    # from the {args.*} placeholders the entry uses (each required, any type).
    input_schema: dict[str, Any] | None = None
    # The provider (`[webhooks.<provider>]` or one of EFFECTLEDGER_WEBHOOK_SECRETS) whose
    # verified events may decide this tool's operations; no other provider's webhook ever
    # speaks for it. None: no webhook decides this tool (readback, the answer or a person do).
    webhook_provider: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not TOOL_NAME.match(v):
            raise ValueError("must match [a-z][a-z0-9_]{0,62}")
        return v

    @field_validator("result_path")
    @classmethod
    def _result_path(cls, v: str | None) -> str | None:
        return None if v is None else check_result_path(v)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        try:
            urltemplate.parse(v)
        except TemplateSyntaxError as exc:
            raise ValueError(str(exc)) from exc
        return v

    @field_validator("body")
    @classmethod
    def _body(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            for name in _placeholders(v):
                if not KNOWN.match(name):
                    raise ValueError(f"unknown placeholder {{{name}}}: use {{operation_key}}, "
                                     f"{{operation_id}}, {{epoch}} or {{args.<path>}}")
        return v

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            try:
                Draft202012Validator.check_schema(v)
            except SchemaError as exc:
                raise ValueError(f"not a valid JSON Schema (2020-12): {exc.message}") from exc
            if v.get("type", "object") != "object":
                raise ValueError("must describe an object (the arguments are a JSON object)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Tool:
        if self.effect_class is EffectClass.IDEMPOTENT and not (
            self.capabilities.accepts_idempotency_key and self.idempotency_header
        ):
            raise ValueError("effect_class 'idempotent' requires capabilities."
                             "accepts_idempotency_key and an idempotency_header")
        if self.capabilities.readback and self.readback is None:
            raise ValueError("capabilities.readback is set but no [readback] section is given")
        if self.capabilities.webhooks and self.webhook_provider is None:
            # The provider a webhook comes from is not inferable from a URL: a tool that takes
            # webhooks names the one provider whose events may decide it (bound by default).
            raise ValueError("capabilities.webhooks is set but no webhook_provider names the "
                             "provider whose signed webhooks may decide this tool")
        for key, value in self.headers.items():
            if key.lower() in {"idempotency-key", "fencing-token"}:
                raise ValueError(f"header {key!r} is set by the dispatcher, not the catalog")
            if ENV_REF.search(value) is None and _looks_secret(key):
                raise ValueError(f"header {key!r} looks like a secret: reference it as ${{ENV}}")
        return self

    def digest(self) -> str:
        # Every intent records its tool's digest: computed once per Tool object, not per
        # intent (20 us each on a slow machine).
        return _DIGESTS(self)

    def public_view(self) -> dict[str, Any]:
        """The entry as agents may see it: header values (which may name secrets) withheld."""
        data = self.model_dump(mode="json")
        data["headers"] = sorted(self.headers)
        data["digest"] = self.digest()
        data["input_schema"] = tool_input_schema(self)
        return data

    def arg_placeholders(self) -> list[str]:
        """The `args.<path>` placeholders the entry uses (endpoint, body, readback URL)."""
        names = list(_placeholders(self.body or {}))
        names += urltemplate.parse(self.endpoint).placeholders
        if self.readback is not None:
            names += urltemplate.parse(self.readback.url, allow_epoch=False).placeholders
        return sorted({n for n in names if n.startswith("args.")})


def _placeholders(value: Any) -> list[str]:
    """Every `{...}` placeholder in the strings of a (nested) template value."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in _placeholders(v)]
    if isinstance(value, list):
        return [n for v in value for n in _placeholders(v)]
    if isinstance(value, str):
        return [p.value for p in urltemplate.tokens(value) if p.kind == "placeholder"
                and _IDENT.match(p.value)]
    return []


# Only identifier-like braces count as placeholders in a body, so literal JSON-ish text such as
# "{}" or "{ a: 1 }" in a body value is left alone.
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def tool_input_schema(tool: Tool) -> dict[str, Any]:
    """The JSON Schema (2020-12) the tool's arguments must satisfy.

    The declared `input_schema`, else one derived from the `{args.*}` placeholders: each top-level
    argument (and each nested one a placeholder walks into) is required, of any type.
    """
    if tool.input_schema is not None:
        return {"$schema": "https://json-schema.org/draft/2020-12/schema", **tool.input_schema}
    root: dict[str, Any] = {"type": "object", "properties": {}, "required": []}
    for name in tool.arg_placeholders():
        node = root
        parts = name.split(".")[1:]
        for i, part in enumerate(parts):
            if part not in node["required"]:
                node["required"].append(part)
            if i == len(parts) - 1:
                node["properties"].setdefault(part, {})
            else:
                child = node["properties"].get(part)
                if not child:
                    child = {"type": "object", "properties": {}, "required": []}
                    node["properties"][part] = child
                node = child
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **root}


V = TypeVar("V")


class PerTool(Generic[V]):
    """`compute(tool)` once per Tool object, remembered by the object itself (a Tool holds
    dicts, so it is not hashable; an id reused by a new object is not taken for the old one).
    Catalogs are few and long-lived; the memo is cleared if reloads ever fill it."""

    def __init__(self, compute: Callable[[Tool], V], *, limit: int = 1024) -> None:
        self.compute, self.limit = compute, limit
        self.memo: dict[int, tuple[Tool, V]] = {}

    def __call__(self, tool: Tool) -> V:
        hit = self.memo.get(id(tool))
        if hit is not None and hit[0] is tool:
            return hit[1]
        if len(self.memo) >= self.limit:
            self.memo.clear()
        value = self.compute(tool)
        self.memo[id(tool)] = (tool, value)
        return value


def _tool_digest(tool: Tool) -> str:
    data = tool.model_dump(mode="json")
    # Fields added after entries were first digested count only when set, so an entry that
    # does not use them keeps the digest its receipts already carry.
    for name, default in _LATER_FIELDS.items():
        if data.get(name) == default:
            del data[name]
    return digest(data)


_DIGESTS: PerTool[str] = PerTool(_tool_digest)  # Tool.digest's
_LATER_FIELDS: dict[str, Any] = {"max_result_bytes": MAX_RESULT_BYTES, "result_path": None,
                                 "dedupe_window_s": DEFAULT_DEDUPE_WINDOW_S, "title": "",
                                 "reversibility": None}


def _looks_secret(header: str) -> bool:
    h = header.lower()
    return h in {"authorization", "x-api-key", "api-key"} or "secret" in h or "token" in h


class Catalog:
    def __init__(self, tools: dict[str, Tool],
                 webhooks: dict[str, WebhookProvider] | None = None) -> None:
        self.tools = tools
        self.webhooks = webhooks or {}

    def webhook_tools(self, provider: str) -> frozenset[str]:
        """The tools whose operations a verified webhook from `provider` may decide.

        A tool accepts its own provider only, the one its `webhook_provider` names; a tool
        naming none accepts no webhook at all (bound by default: any configured provider's
        signed event naming its operation key is refused, never applied).
        """
        return frozenset(n for n, t in self.tools.items() if t.webhook_provider == provider)

    def webhook_speaks_for(self, provider: str, tool: str) -> bool:
        """Whether a verified webhook from `provider` may decide an operation of `tool` (the
        rule of `webhook_tools`, asked from the tool's side, e.g. for stored early webhooks)."""
        t = self.tools.get(tool)
        return t is not None and t.webhook_provider is not None and t.webhook_provider == provider

    def webhook_providers(self) -> frozenset[str]:
        """Every provider the catalog names (declared, or bound to a tool): the bounded label
        set of the webhook metrics."""
        return frozenset(self.webhooks) | {t.webhook_provider for t in self.tools.values()
                                           if t.webhook_provider is not None}

    def get(self, name: str) -> Tool:
        tool = self.tools.get(name)
        if tool is None:
            raise UnknownTool(f"unknown tool {name!r}", known=sorted(self.tools)[:50])
        return tool

    def digest(self) -> str:
        return digest({n: t.digest() for n, t in sorted(self.tools.items())})

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "<catalog>") -> Catalog:
        raw_tools = data.get("tools")
        if not isinstance(raw_tools, dict) or not raw_tools:
            raise CatalogError(f"{source}: expected a [tools.<name>] table with at least one tool")
        unknown_top = set(data) - {"tools", "catalog_version", "webhooks"}
        if unknown_top:
            raise CatalogError(f"{source}: unknown top-level keys {sorted(unknown_top)}")
        tools: dict[str, Tool] = {}
        for name, body in raw_tools.items():
            if not isinstance(body, dict):
                raise CatalogError(f"{source}: tool {name!r}: expected a table")
            try:
                tools[name] = Tool.model_validate({**body, "name": name})
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(p) for p in err["loc"]) or "<tool>"
                raise CatalogError(
                    f"{source}: tool {name!r}, field {field!r}: {err['msg']}",
                    tool=name, field=field) from exc
        # A tool's webhook_provider may also name a provider configured only through
        # EFFECTLEDGER_WEBHOOK_SECRETS (Standard Webhooks, effectledger's own event shape).
        return cls(tools, _webhooks(data.get("webhooks", {}), source))

    @classmethod
    def load(cls, path: str | Path) -> Catalog:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError as exc:
            raise CatalogError(f"catalog file not found: {p}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise CatalogError(f"{p}: not valid TOML: {exc}") from exc
        return cls.from_mapping(data, str(p))


def _webhooks(raw: Any, source: str) -> dict[str, WebhookProvider]:
    if not isinstance(raw, dict):
        raise CatalogError(f"{source}: 'webhooks' must be a table of [webhooks.<provider>]")
    out: dict[str, WebhookProvider] = {}
    for name, body in raw.items():
        if not isinstance(body, dict):
            raise CatalogError(f"{source}: webhooks {name!r}: expected a table")
        try:
            out[name] = WebhookProvider.model_validate({**body, "name": name})
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "<webhooks>"
            raise CatalogError(f"{source}: webhooks {name!r}, field {field!r}: {err['msg']}",
                               provider=name, field=field) from exc
    return out


def render(template: Any, *, operation_key: str, operation_id: str, epoch: int,
           arguments: dict[str, Any]) -> Any:
    """Render `{operation_key}`, `{operation_id}`, `{epoch}` and `{args.x.y}` in a template.

    A string that is exactly one placeholder takes the placeholder's value with its JSON type
    (so `"{args.amount}"` stays a number); placeholders inside longer strings are stringified.
    """
    if isinstance(template, dict):
        return {k: render(v, operation_key=operation_key, operation_id=operation_id, epoch=epoch,
                          arguments=arguments) for k, v in template.items()}
    if isinstance(template, list):
        return [render(v, operation_key=operation_key, operation_id=operation_id, epoch=epoch,
                       arguments=arguments) for v in template]
    if not isinstance(template, str):
        return template

    def value(name: str) -> Any:
        return urltemplate.lookup(name, operation_key=operation_key, operation_id=operation_id,
                                  epoch=epoch, arguments=arguments)

    whole = PLACEHOLDER.fullmatch(template)
    if whole:
        return value(whole.group(1))
    return PLACEHOLDER.sub(lambda m: str(value(m.group(1))), template)


def resolve_env(value: str, env: dict[str, str]) -> str:
    """Replace `${NAME}` with the environment's value; a missing variable is a config error."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in env:
            raise CatalogError(f"environment variable {name} is not set")
        return env[name]
    return ENV_REF.sub(sub, value)
