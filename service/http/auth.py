"""API keys: one check, made by the outermost middleware before a body is read, for every path
but the probes and /metrics (docs/security.md says why those stay open; BERTSERVE_METRICS_TOKEN
puts /metrics behind a token of its own) and the management API (admin keys: `check_admin`).
The HTTP protocol uses `authorized` too, to tell
keyed connections from anonymous ones (service.http.protocol)."""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable

from bertserve.service.http.errors import Forbidden, Unauthorized

PUBLIC_PATHS = frozenset(
    {"/health/live", "/health/ready", "/metrics", "/v2/health/live", "/v2/health/ready"}
)
# The management API (service.control): admin keys only, for every POST under /models/ (a
# pattern of the routes' own would differ from the router's: Starlette's `$` also matches
# before a trailing newline, so `/models/x/load%0A` reached the route past a fullmatch).
MANAGEMENT = re.compile(r"/models/[^/]+/(load|unload)")
MANAGEMENT_PREFIX = "/models/"
MIN_KEY_LENGTH = 16


def authorizations(headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    """Every Authorization header of a request (names lower-cased, as ASGI and uvicorn give)."""
    return [value for name, value in headers if name == b"authorization"]


def bearer(given: list[bytes]) -> bytes:
    """The token of `given` (a request's Authorization headers) if it is one `Bearer <token>`,
    else b"" (which no key equals: keys have MIN_KEY_LENGTH characters). Two headers are
    refused: proxies and servers disagree on which one counts."""
    if len(given) != 1:
        return b""
    scheme, _, token = given[0].partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def authorized(keys: tuple[bytes, ...], given: list[bytes]) -> bool:
    """Whether `given` (a request's Authorization headers) is one `Bearer <one of keys>`. Every
    key is compared in constant time, so neither a key's length nor its prefix leaks through
    timing."""
    token = bearer(given)
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return ok


def check_key(keys: tuple[bytes, ...], given: list[bytes]) -> None:
    """Raise Unauthorized unless `given` passes `authorized` (no keys: every request does)."""
    if keys and not authorized(keys, given):
        many = " (one Authorization header, not several)" if len(given) > 1 else ""
        raise Unauthorized(
            f"send an API key as 'Authorization: Bearer <key>'{many}",
            headers={"WWW-Authenticate": "Bearer"},
        )


def check_admin(
    admin_keys: tuple[bytes, ...], api_keys: tuple[bytes, ...], given: list[bytes]
) -> None:
    """The management API's check: an admin key passes; an API key is a 403, as is any call
    while no admin key is set (the API is off); anything else a 401."""
    if not admin_keys:
        raise Forbidden(
            "the model management API is off: start the service with "
            "BERTSERVE_MODEL_CONTROL=explicit and BERTSERVE_ADMIN_KEYS"
        )
    if authorized(admin_keys, given):
        return
    if api_keys and authorized(api_keys, given):
        raise Forbidden("an API key cannot manage models; send an admin key (BERTSERVE_ADMIN_KEYS)")
    raise Unauthorized(
        "send an admin key as 'Authorization: Bearer <key>' (BERTSERVE_ADMIN_KEYS)",
        headers={"WWW-Authenticate": "Bearer"},
    )
