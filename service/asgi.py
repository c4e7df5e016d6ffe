"""A small ASGI helper shared by the middlewares that read a request body before the app does."""

from __future__ import annotations

from starlette.types import Message, Receive


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
