"""Size bounds applied at every entry: identifiers, arguments, messages, provider references."""

MAX_IDENTIFIER_BYTES = 1024
MAX_ARGUMENTS_BYTES = 64 * 1024
MAX_JSON_DEPTH = 32
MAX_MESSAGE_BYTES = 256 * 1024
MAX_HTTP_BODY_BYTES = 256 * 1024
MAX_PROVIDER_REF_BYTES = 256
# Provider references one duplicate finding names (every effect listed for one key).
MAX_DUPLICATE_REFS = 100
MAX_ERROR_TEXT_BYTES = 1024


def declared_length(header: str) -> int | None:
    """A Content-Length value as a number of bytes; None when it is not one. ASCII digits
    only: `str.isdigit()` alone also takes digits such as "\u00b2", which `int()` refuses."""
    return int(header) if header.isascii() and header.isdigit() else None
