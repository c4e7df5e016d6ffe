"""Small ASGI helpers shared by the middlewares (and the protocol, for the request id)."""

from __future__ import annotations

import asyncio
import re

from starlette.types import Message, Receive, Scope

# A client's X-Request-ID is kept when it is plainly an id: it goes into logs and headers.
SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


# The scope extension through which bertserve's protocol (service.protocol) hands a request a
# future that completes when its connection is lost: a request waiting for the model awaits it
# with a callback, where watching `receive` for "http.disconnect" takes a task a request.
CONNECTION_LOST = "bertserve.connection_lost"


def connection_lost(scope: Scope) -> asyncio.Future[None] | None:
    """The future that completes when this request's connection is lost; None under a server
    that does not provide one."""
    extension = (scope.get("extensions") or {}).get(CONNECTION_LOST)
    return extension["future"] if extension else None


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
