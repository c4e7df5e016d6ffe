"""Small ASGI helpers shared by the middlewares (and the protocol, for the request id)."""

from __future__ import annotations

import re

from starlette.types import Message, Receive

# A client's X-Request-ID is kept when it is plainly an id: it goes into logs and headers.
SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def replaying(first: Message, receive: Receive) -> Receive:
    """A `receive` that hands out `first` once, then defers to the server's `receive` (which is
    where the route's disconnect watch finds `http.disconnect`)."""
    pending: Message | None = first

    async def replay() -> Message:
        nonlocal pending
        if pending is not None:
            msg, pending = pending, None
            return msg
        return await receive()

    return replay
