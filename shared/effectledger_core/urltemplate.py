"""URL templates for `endpoint` and `readback.url`: where a request goes is the catalog's word.

A template is literal text, `${NAME}` environment references and `{placeholder}`s:
`{operation_key}`, `{operation_id}`, `{epoch}` and `{args.<path>}`.

- Environment references are configuration (a base URL per environment, an account id); their
  values are inserted as written and may form the scheme and host. They are resolved only in the
  processes that call the provider, which hold that environment.
- Placeholders carry caller data, so they may only appear in the path or the query, after the
  host has ended, and each value is percent-encoded as ONE segment: `/`, `?`, `#`, `&`, `=` and
  `%` in an argument are encoded, and a segment that renders as `.`, `..` or nothing is refused
  (HTTP clients normalise dot segments away, and an empty id would address the collection).
  An argument can therefore never change the scheme, host, port or the path above its segment.

`parse` checks a template once, at catalog load; `render` is called per request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import quote, urlsplit

from .errors import CatalogError

# `${NAME}` (environment) or `{...}` (a placeholder, valid or not: unknown ones are refused).
_TOKEN = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\{([^{}]*)\}")
KNOWN = re.compile(r"^(operation_key|operation_id|epoch|args(?:\.[A-Za-z0-9_-]+)+)$")


class TemplateError(ValueError):
    """A template cannot be rendered for these values (missing argument, unsafe value)."""


class TemplateSyntaxError(ValueError):
    """A catalog template is invalid; the message names the problem, the caller the field."""


@dataclass(frozen=True, slots=True)
class Part:
    kind: str  # "text" | "env" | "placeholder"
    value: str  # the literal text, the variable name or the placeholder name


@dataclass(frozen=True, slots=True)
class UrlTemplate:
    source: str
    parts: tuple[Part, ...]

    @property
    def placeholders(self) -> list[str]:
        return [p.value for p in self.parts if p.kind == "placeholder"]

    @property
    def env_names(self) -> list[str]:
        return [p.value for p in self.parts if p.kind == "env"]


def tokens(text: str) -> list[Part]:
    """Split any template string into literal text, `${ENV}` and `{placeholder}` parts."""
    parts: list[Part] = []
    pos = 0
    for m in _TOKEN.finditer(text):
        if m.start() > pos:
            parts.append(Part("text", text[pos:m.start()]))
        if m.group(1) is not None:
            parts.append(Part("env", m.group(1)))
        else:
            parts.append(Part("placeholder", m.group(2)))
        pos = m.end()
    if pos < len(text):
        parts.append(Part("text", text[pos:]))
    return parts


@lru_cache(maxsize=1024)
def parse(source: str, *, allow_epoch: bool = True) -> UrlTemplate:
    """Check a URL template (once per process); raise TemplateSyntaxError saying what is wrong."""
    parts = tuple(tokens(source))
    for p in parts:
        if p.kind == "placeholder" and not KNOWN.match(p.value):
            raise TemplateSyntaxError(
                f"unknown placeholder {{{p.value}}}: use {{operation_key}}, {{operation_id}}, "
                f"{{epoch}} or {{args.<path>}} (and ${{NAME}} for the environment)")
        if p.kind == "placeholder" and p.value == "epoch" and not allow_epoch:
            raise TemplateSyntaxError("{epoch} is not allowed here: a readback spans all epochs")
    literal = "".join(p.value for p in parts if p.kind == "text")
    if "#" in literal:
        raise TemplateSyntaxError("a URL fragment ('#') is never sent to the provider")
    if parts and parts[0].kind == "text":
        scheme = parts[0].value.split("://", 1)[0] if "://" in parts[0].value else ""
        if scheme not in ("http", "https"):
            raise TemplateSyntaxError("must be an http:// or https:// URL (or start with "
                                      "${NAME} holding one)")
    elif not parts or parts[0].kind != "env":
        raise TemplateSyntaxError("must be an http:// or https:// URL")
    first = next((i for i, p in enumerate(parts) if p.kind == "placeholder"), None)
    if first is not None and not _host_ended(parts[:first]):
        raise TemplateSyntaxError(
            "placeholders may only appear in the path or query: the scheme and host come from "
            "the catalog alone")
    return UrlTemplate(source, parts)


def _host_ended(prefix: tuple[Part, ...]) -> bool:
    """True if the literal text before the first placeholder already left the authority."""
    text = ""
    for p in prefix:
        if p.kind == "env":
            # An environment value is trusted but unknown here: it may be a whole base URL, so
            # only literal text after it can prove the host has ended.
            text += "\x00" if not text else "x"
        else:
            text += p.value
    if text.startswith("\x00"):
        rest = text[1:]
        return rest.startswith(("/", "?"))
    after = text.split("://", 1)[1] if "://" in text else ""
    return "/" in after or "?" in after


def lookup(name: str, *, operation_key: str, operation_id: str, epoch: int,
           arguments: Mapping[str, Any]) -> Any:
    """The value of one placeholder (`args.a.b` walks nested objects)."""
    if name == "operation_key":
        return operation_key
    if name == "operation_id":
        return operation_id
    if name == "epoch":
        return epoch
    cur: Any = arguments
    for part in name.split(".")[1:]:
        if not isinstance(cur, Mapping) or part not in cur:
            raise TemplateError(f"argument {name[5:]!r} is missing")
        cur = cur[part]
    return cur


def _scalar_text(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise TemplateError(f"{{{name}}} must be a string or a number to go into a URL, "
                        f"not {type(value).__name__}")


def render(template: UrlTemplate, *, operation_key: str, operation_id: str, epoch: int,
           arguments: Mapping[str, Any], env: Mapping[str, str]) -> str:
    """The URL for one request; raise TemplateError (values) or CatalogError (environment)."""
    out: list[str] = []
    mask: list[str] = []  # per character: "p" if it came from a placeholder's value
    origin: str | None = None
    for p in template.parts:
        if p.kind == "placeholder":
            so_far = "".join(out)
            if origin is None:
                origin = _origin(so_far)
            text = quote(_scalar_text(p.value, lookup(
                p.value, operation_key=operation_key, operation_id=operation_id, epoch=epoch,
                arguments=arguments)), safe="")
            if not text and "?" not in so_far:
                raise TemplateError(f"{{{p.value}}} is empty: an empty path segment would "
                                    f"address another resource")
            out.append(text)
            mask.append("p" * len(text))
            continue
        if p.kind == "env":
            if p.value not in env:
                raise CatalogError(f"environment variable {p.value} is not set")
            text = env[p.value]
        else:
            text = p.value
        out.append(text)
        mask.append("t" * len(text))
    url, marks = "".join(out), "".join(mask)
    split = urlsplit(url)
    if split.scheme not in ("http", "https") or not split.hostname:
        raise TemplateError("the URL does not start with http(s)://host once the environment "
                            "is applied")
    if origin is not None and f"{split.scheme}://{split.netloc}" != origin:
        raise TemplateError("an argument would change the request's host")
    _check_segments(url, marks)
    return url


def _origin(prefix: str) -> str:
    split = urlsplit(prefix)
    if split.scheme not in ("http", "https") or not split.netloc or not (
            split.path.startswith("/") or "?" in prefix):
        raise TemplateError("a placeholder would be part of the host: the URL before the first "
                            "placeholder must end the host with '/' or '?'")
    return f"{split.scheme}://{split.netloc}"


def _check_segments(url: str, marks: str) -> None:
    """Refuse a path segment that a placeholder made `.` or `..` (clients drop dot segments)."""
    start = url.index("//") + 2
    start = url.find("/", start)
    if start < 0:
        return
    end = url.find("?", start)
    end = len(url) if end < 0 else end
    pos = start + 1
    for segment in url[start + 1:end].split("/"):
        if segment in (".", "..") and "p" in marks[pos:pos + len(segment)]:
            raise TemplateError("an argument would make a path segment '.' or '..'")
        pos += len(segment) + 1
