"""uvicorn's HTTP/1.1 protocol with a header timeout: a client that opens a connection (or
starts a new request on a kept-alive one) and does not finish its request line and headers
within `header_timeout` seconds gets a 408 and the connection is closed. uvicorn itself waits
forever, so a few hundred slow clients could hold every connection (slowloris). The body's
own timeout is the app's (service.app.BodyLimit)."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

_BODY = b'{"error": "the request headers did not arrive in time", "error_type": "timeout"}'
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    + b"content-length: %d\r\n\r\n" % len(_BODY)
    + _BODY
)


def guarded_protocol(header_timeout: float) -> type[H11Protocol]:
    """The protocol class for one server, with its own timeout."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})


class GuardedH11Protocol(H11Protocol):
    header_timeout = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # its headers are in: the request is the app's now

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return
        if not self.transport.is_closing():
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()
