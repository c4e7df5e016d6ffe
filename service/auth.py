"""API keys: one check, made by the outermost middleware before a body is read, for every path
but the probes and /metrics (docs/security.md says why those stay open)."""

from __future__ import annotations

import hmac

from service.errors import Unauthorized

PUBLIC_PATHS = frozenset({"/health/live", "/health/ready", "/metrics"})
MIN_KEY_LENGTH = 16


def check_key(keys: tuple[bytes, ...], authorization: bytes | None) -> None:
    """Raise Unauthorized unless `authorization` is `Bearer <one of keys>`. Every key is compared
    in constant time, so neither a key's length nor its prefix leaks through timing."""
    if not keys:
        return
    scheme, _, given = (authorization or b"").partition(b" ")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given.strip(), key)
    if scheme.lower() != b"bearer" or not ok:
        raise Unauthorized(
            "send an API key as 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
