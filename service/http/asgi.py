"""Small ASGI helpers shared by the middlewares (and the protocol, for the request id)."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.types import Message, Receive, Scope

from bertserve.runtime.schemas import PRIORITIES
from bertserve.service.http.errors import InvalidInput

if TYPE_CHECKING:
    from bertserve.service.state import Slot

# A client's X-Request-ID is kept when it is plainly an id: it goes into logs and headers.
SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


# The scope extension through which bertserve's protocol (service.http.protocol) hands a request a
# future that completes when its connection is lost: a request waiting for the model awaits it
# with a callback, where watching `receive` for "http.disconnect" takes a task a request.
CONNECTION_LOST = "bertserve.connection_lost"
# The scope key by which the protocol says it admitted a request and took its in-flight slot
# (ServiceState.admit): the middleware then does not decide again.
ADMITTED = "bertserve.admitted"

# The scope state key of when the app's outermost middleware first saw the request
# (time.monotonic): where a request's own timeout counts from.
ARRIVED = "arrived"

Disconnected = Callable[[], Awaitable[None]]  # completes when the client goes away
# What tells a waiting request that its client went away (service.handler.submit).
Gone = asyncio.Future[None] | Disconnected


def disconnect_watch(scope: Scope, receive: Receive) -> Gone:
    """The protocol's per-connection future (CONNECTION_LOST) where the server provides one;
    under any other ASGI server, a watch of `receive` for "http.disconnect"."""
    extension = (scope.get("extensions") or {}).get(CONNECTION_LOST)
    if extension:
        future: asyncio.Future[None] = extension["future"]
        return future

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return disconnected


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


def user_agent(scope: Scope) -> bytes:
    """The request's User-Agent header (empty if it sent none)."""
    return next((v for k, v in scope["headers"] if k == b"user-agent"), b"")


def admitted(scope: Scope) -> Slot | None:
    """The request's place, given by the protocol's gate (service.state.Slot); None where
    another server runs the app."""
    return scope.get("extensions", {}).get(ADMITTED)


# A request's place among the queued work, where a body has no field for it (docs/api.md).
HEADERS = ("X-Request-Priority", "X-Request-Timeout-Ms")


@dataclass(frozen=True, slots=True)
class Urgency:
    """What a request asks of the queue: its priority (PRIORITIES, lower first; None: its
    body's, else the settings' default for its kind) and its own timeout (None: the settings'
    request_timeout_s, which also caps it)."""

    priority: int | None = None
    timeout_s: float | None = None
    since: float | None = None  # when the timeout began (time.monotonic); None: at the handler


def parse_urgency(
    priority: str | None, timeout_ms: str | None, names: tuple[str, str] = HEADERS
) -> Urgency:
    """An Urgency from the text of its two values (headers, gRPC metadata: `names`);
    InvalidInput (400) naming what is wrong otherwise."""
    low, high = PRIORITIES
    value: int | None = None
    if priority is not None:
        text = priority.strip()
        # ASCII digits only: int() would also take "1_000" and other scripts' digits
        value = int(text) if re.fullmatch(r"[0-9]{1,3}", text) else None
        if value is None or not low <= value <= high:
            raise InvalidInput(
                f"{names[0]} must be an integer from {low} (served first) to "
                f"{high}; got {priority[:40]!r}"
            )
    seconds: float | None = None
    if timeout_ms is not None:
        try:
            seconds = float(timeout_ms.strip()) / 1000
        except ValueError:
            seconds = None
        if seconds is None or not math.isfinite(seconds) or seconds <= 0:
            raise InvalidInput(
                f"{names[1]} must be a positive number of milliseconds; got {timeout_ms[:40]!r}"
            )
    return Urgency(value, seconds)


def urgency(scope: Scope) -> Urgency:
    """The request's X-Request-Priority and X-Request-Timeout-Ms headers (parse_urgency), its
    timeout counted from when the app first saw it (ARRIVED in its state)."""
    priority = timeout = None
    for name, value in scope["headers"]:
        if name == b"x-request-priority":
            priority = value.decode("latin-1")
        elif name == b"x-request-timeout-ms":
            timeout = value.decode("latin-1")
    arrived = scope.get("state", {}).get(ARRIVED)
    if priority is None and timeout is None:
        return NO_URGENCY if arrived is None else Urgency(since=arrived)
    asked = parse_urgency(priority, timeout)
    return Urgency(asked.priority, asked.timeout_s, arrived)


NO_URGENCY = Urgency()
