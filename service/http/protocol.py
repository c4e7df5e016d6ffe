"""uvicorn's httptools HTTP/1.1 protocol with guards that act before a request becomes an ASGI
task (so they cost a few microseconds, not a request's worth of Python):

- a header timeout: a client that opens a connection, or starts a request on a kept-alive one,
  and does not finish its request line and headers within `header_timeout` seconds gets a 408
  and the connection is closed (uvicorn itself waits forever: slowloris);
- a header size limit: a request line and headers past `max_header_bytes` get a 431 and the
  connection is closed, before the parser has buffered them (httptools buffers any size);
- the same two bounds for a chunked body's trailer section (after the last chunk; httptools
  buffers it, joining a value piece by piece, and uvicorn ignores it): at most
  `max_header_bytes` and `header_timeout`, counted from the last chunk's size line; past either
  the connection is closed (with a 431 or 408 if no answer has started). A pause after a
  data chunk's size line, its data still to come, is the body timeout's, not this one's;
- anonymous connections (API keys set; `Connections`): a connection counts as keyed once a
  request on it carries a valid key. Past `max_anonymous` of the others, or past the process's
  connection cap, the oldest idle anonymous ones are closed, so clients without a key cannot
  take the connections keyed clients need;
- the gate (`ServiceState.admit`, decided once a request, here and nowhere else): while the
  service drains, or when it is past its in-flight or connection cap, or every model for the
  path has a full queue, the request is answered here, without the app, with a 503/429 and
  `Retry-After` once its bytes are in, and its body is dropped unread into the parser; an
  admitted one takes its in-flight slot here once its body is complete (service.state.Slot),
  so a burst read in one loop turn cannot pass the cap, and a body that trickles in holds no
  slot while it does. A request pipelined behind another meets the gate when its turn comes.
  Under 5x overload this is what keeps every answer an HTTP answer: the event loop refuses at
  tens of thousands a second instead of a few thousand.

The body's own timeout is the app's (service.http.app.BodyLimit)."""

from __future__ import annotations

import array
import asyncio
import fcntl
import re
import termios
import urllib.parse
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from bertserve.service.http.asgi import ADMITTED, CONNECTION_LOST, SAFE_ID
from bertserve.service.http.auth import authorizations, authorized
from bertserve.service.http.errors import (
    BadRequest,
    HeadersTooLarge,
    RequestError,
    RequestTimeout,
    Unavailable,
    answer_of,
    error_body,
)

if TYPE_CHECKING:
    from bertserve.service.state import Slot

# The stream's end when a chunked body waits after a data chunk's size line (a size other than
# 0, maybe an extension): the framing timer leaves it to the body timeout. RECENT: the bytes
# kept to see it (a longer extension is timed as trailers).
DATA_SIZE_LINE = re.compile(rb"\n0*[1-9a-fA-F][0-9a-fA-F]*(;[^\r\n]*)?\r\n\Z")
RECENT = 256


def response_parts(
    error: RequestError, request_id: bytes | None = None, path: str = ""
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """A typed error's status, headers and body, as the app's error response has them (in the
    shape of `path`'s clients: service.http.errors.error_body)."""
    answer = answer_of(error)
    body = error_body(error.message, answer.error_type, answer.status, path)
    headers = [(b"content-type", b"application/json")]
    headers += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()
    ]
    if request_id:
        headers.append((b"x-request-id", request_id))
    headers.append((b"content-length", b"%d" % len(body)))
    return answer.status, headers, body


def encode(error: RequestError, request_id: bytes | None = None) -> bytes:
    """A typed error as the whole HTTP/1.1 response the app would send for it."""
    return response_bytes(*response_parts(error, request_id))


def response_bytes(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """Status line, headers and body as one HTTP/1.1 response."""
    reason = HTTPStatus(status).phrase.encode("ascii")
    lines = [b"HTTP/1.1 %d %s" % (status, reason), *(k + b": " + v for k, v in headers)]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def request_id_of(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The client's X-Request-ID where it is safe to echo, else None."""
    given = dict(headers).get(b"x-request-id")
    if given is None or not SAFE_ID.fullmatch(given.decode("latin-1")):
        return None
    return given


CLOSE = (b"connection", b"close")  # a refusal's header that ends its connection
TIMEOUT_RESPONSE = encode(
    RequestTimeout("the request headers did not arrive in time", {"Connection": "close"})
)
ANONYMOUS_CROWDED = Unavailable(
    "too many connections without an API key are open; send one", {"Connection": "close"}
)


@dataclass
class Connections:
    """One server's connections that have sent no valid API key yet, oldest first, and the caps
    that close the idle ones among them (`keys` empty: no key is asked for, none is anonymous)."""

    keys: tuple[bytes, ...] = ()
    max_anonymous: int = 256
    max_connections: int = 2048
    anonymous: dict[GuardedProtocol, None] = field(default_factory=dict)

    def make_room(self, total: int) -> None:
        """Close the oldest idle anonymous connections until both caps hold (`total`: every
        open connection). A busy one (a request in progress or a refusal held) is left, and so
        is the newest, the connection just made."""
        excess = max(len(self.anonymous) - self.max_anonymous, total - self.max_connections)
        if excess <= 0:
            return
        for protocol in list(self.anonymous)[:-1]:
            if excess <= 0:
                return
            if protocol.idle:
                protocol.transport.close()
                del self.anonymous[protocol]
                excess -= 1

    def crowded(self, protocol: GuardedProtocol) -> bool:
        """An anonymous request that finds the anonymous cap full of busy connections."""
        return protocol in self.anonymous and len(self.anonymous) > self.max_anonymous


# (method, path, connections, the body's declared size or -1, its Authorization headers) -> a
# refusal, or the admitted request's slot (service.state.Slot)
Gate = Callable[[str, str, int, int, list[bytes]], "RequestError | Slot"]
Refused = Callable[[str, RequestError], None]  # count it: (path, refusal)
Opened = Callable[[int], None]  # a connection opened (+1) or closed (-1)


def guarded_protocol(
    header_timeout: float,
    gate: Gate | None = None,
    refused: Refused | None = None,
    refusal_delay: float = 0.0,
    opened: Opened | None = None,
    max_header_bytes: int = 32_768,
    connections: Connections | None = None,
) -> type[HttpToolsProtocol]:
    """The protocol class for one server, with its own timeout, gate, refusal delay, count of
    open connections, header limit and anonymous connections."""
    return type(
        "GuardedProtocol",
        (GuardedProtocol,),
        {
            "header_timeout": header_timeout,
            "gate": staticmethod(gate) if gate else None,
            "refused": staticmethod(refused) if refused else None,
            "opened": staticmethod(opened) if opened else None,
            "refusal_delay": refusal_delay,
            "max_header_bytes": max_header_bytes,
            "policy": connections or Connections(),
        },
    )


class GuardedProtocol(HttpToolsProtocol):
    header_timeout = 10.0
    gate: Gate | None = None
    refused: Refused | None = None
    opened: Opened | None = None
    refusal_delay = 0.0
    max_header_bytes = 32_768
    policy = Connections()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refusal: RequestError | None = None
        self._refusal_path = ""
        # A refusal waiting out refusal_delay, and whether the connection closes after it.
        self._held: tuple[bytes, bool] | None = None
        self._held_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # reading a request line and headers (the size limit counts them)
        self.last_read = 0.0  # loop time of the client's last bytes (a retiring worker's closes)
        self._head_bytes = 0
        self._tail = b""  # the last bytes of the head so far: its end may straddle two reads
        # Bytes read since a chunk's size line, before any of its data: the trailers after the
        # last one (None: not between a size line and its data). Counted over whole reads that
        # begin and end there (`_reads`, `_framing_read`): the one that holds the size line
        # may hold data and earlier chunks too.
        self._framing: int | None = None
        self._reads = 0
        self._framing_read = 0
        self._recent = b""  # the last bytes read (a size line's, when the framing timer ends)

    def quiet_for(self) -> float:
        """Seconds since the client last sent anything, while nothing is in progress (0 if it
        is busy)."""
        return self.loop.time() - self.last_read if self.idle else 0.0

    @property
    def idle(self) -> bool:
        """No request in progress and no refusal held: closing it loses nothing."""
        busy = self.cycle is not None and not self.cycle.response_complete
        return not busy and self._held is None and not self.transport.is_closing()

    # --- the header timeout: armed from a request's first byte to its last header -------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._lost: asyncio.Future[None] = self.loop.create_future()
        if self.opened is not None:
            self.opened(1)
        self._arm()
        if self.policy.keys:
            self.policy.anonymous[self] = None
            self.policy.make_room(len(self.connections))

    # --- the header size limit ----------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        self._reads += 1
        if self._in_head:
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            size = self._head_bytes + (len(data) if end < 0 else end + 4 - len(self._tail))
            if size > self.max_header_bytes:
                self._in_head = False
                if not self.transport.is_closing():
                    limit = f"{self.max_header_bytes:,}"
                    too_large = HeadersTooLarge(
                        f"the request line and headers are over {limit} bytes",
                        {"Connection": "close"},
                    )
                    self.transport.write(encode(too_large))
                    self.transport.close()
                return
            self._head_bytes, self._tail = size, seen[-3:]
        self._recent = self._recent[-RECENT:] + data[-RECENT:]
        super().data_received(data)
        if self._framing is not None and self._framing_read < self._reads:
            self._framing_received(len(data))  # all of it after a size line, none of it data

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to HTTP its parser cannot read, in the service's error shape (JSON,
        an error_type, an X-Request-ID) instead of plain text; the connection ends after it."""
        if self.transport.is_closing():
            return
        request_id = request_id_of(self.headers) or uuid.uuid4().hex.encode("ascii")
        error = BadRequest(
            f"the request is not HTTP/1.1 the server can read ({msg.rstrip('.')})",
            {"Connection": "close"},
        )
        self.transport.write(encode(error, request_id))
        self.transport.close()

    # --- a chunked body's framing: size lines and trailers, bounded as a head is ----------------

    def on_chunk_header(self) -> None:
        """httptools: a chunk's size line is read. Its data follows (`on_body`), or, for the
        last chunk, the trailer section and then `on_chunk_complete`."""
        self._framing, self._framing_read = 0, self._reads
        self._arm(self._framing_too_slow)

    def on_chunk_complete(self) -> None:
        self._end_framing()

    def _end_framing(self) -> None:
        if self._framing is not None:
            self._framing = None
            self._disarm()

    def _framing_received(self, size: int) -> None:
        """A read of `size` bytes, all between a chunk's size line and its data: past the
        limit the connection ends, having buffered at most two reads more than the limit."""
        assert self._framing is not None
        self._framing += size
        if self._framing > self.max_header_bytes:
            limit = f"{self.max_header_bytes:,}"
            self._close_framing(
                HeadersTooLarge(
                    f"a chunked body's framing or trailers are over {limit} bytes",
                    {"Connection": "close"},
                )
            )

    def _framing_too_slow(self) -> None:
        self._header_timer = None
        if self.pipeline:  # reading waits while an earlier request is answered: so does this
            return self._arm(self._framing_too_slow)
        if DATA_SIZE_LINE.search(self._recent[-RECENT:]):
            # Nothing since a size line other than 0: a data chunk's, its data still to come
            # (no trailer line is bare hex: the parser refuses one). The body timeout bounds it.
            return
        self._close_framing(
            RequestTimeout(
                f"a chunked body's trailers did not arrive within {self.header_timeout:g} s",
                {"Connection": "close"},
            )
        )

    def _close_framing(self, error: RequestError) -> None:
        """End the connection: with `error` as the answer if none has started (and none for an
        earlier request is still to come: it cannot go first), else as it is."""
        self._framing = None
        self._disarm()
        if self.transport.is_closing():
            return
        if not self.pipeline and (self.cycle is None or not self.cycle.response_started):
            self.transport.write(encode(error, request_id_of(self.headers)))
        self.transport.close()

    def on_message_begin(self) -> None:
        self._release(idle_after=False)  # pipelined behind a held refusal: that goes first
        super().on_message_begin()
        extensions = self.scope.setdefault("extensions", {})
        extensions[CONNECTION_LOST] = {"future": self._lost}  # service.http.asgi
        if self._header_timer is None:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.policy.anonymous.pop(self, None)
        if not self._lost.done():
            self._lost.set_result(None)  # requests waiting for the model drop their rows
        if self.opened is not None:
            self.opened(-1)
        self._disarm()
        self._release()  # the transport is closed: this drops a held refusal and its timer
        # uvicorn disarms the keep-alive timer only on a clean close; after a reset it fired on
        # the closed socket (1,656 logged errors in one `make reliability` run).
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        super().connection_lost(exc)

    def _arm(self, fire: Callable[[], None] | None = None) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, fire or self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a pipelined request waits behind one still being answered
        if not self.transport.is_closing():
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()

    # --- closing an idle connection: not while a request waits unread in its socket ----------

    def _request_waiting(self) -> bool:
        """Bytes in the socket that the loop has not read yet. Under load the loop can run the
        keep-alive timer (or a drain's shutdown) before it reads a request the client has
        already sent on the idle connection; closing then resets that request."""
        sock = self.transport.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:  # closed
            return False
        waiting = array.array("i", [0])
        try:
            fcntl.ioctl(sock.fileno(), termios.FIONREAD, waiting, True)
        except (OSError, ValueError):
            return False
        return waiting[0] > 0

    def timeout_keep_alive_handler(self) -> None:
        if not self._request_waiting():
            super().timeout_keep_alive_handler()

    def shutdown(self) -> None:
        self._release(idle_after=False)  # draining: a held refusal is answered before the close
        if (self.cycle is None or self.cycle.response_complete) and self._request_waiting():
            return  # it is read next; draining, the gate answers it 503 and closes
        super().shutdown()

    # --- the gate: refuse from the request line and headers, before any ASGI task --------------

    def on_headers_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes, self._tail = False, 0, b""
        policy = self.policy
        if self in policy.anonymous:
            del policy.anonymous[self]  # keyed from now on, or the newest anonymous one
            if not authorized(policy.keys, authorizations(self.headers)):
                policy.anonymous[self] = None
        idle = self.cycle is None or self.cycle.response_complete  # not behind a pipelined one
        if self.gate is not None and idle and not self.parser.should_upgrade():
            method = self.parser.get_method().decode("ascii")
            path = httptools.parse_url(self.url).path.decode("ascii", "replace")
            if "%" in path:  # the path the app routes on, as uvicorn decodes it
                path = urllib.parse.unquote(path)
            # Last, the gate: an admitted API request's slot, taken once its body is complete.
            decision = self._decide(method, path, self.headers)
            if isinstance(decision, RequestError):
                self._refusal, self._refusal_path = decision, path
                return
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[ADMITTED] = decision
        super().on_headers_complete()
        if type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = OneWriteCycle

    def _decide(
        self, method: str, path: str, headers: Iterable[tuple[bytes, bytes]]
    ) -> RequestError | Slot:
        """The gate, once a request: why it is answered at once, or its slot (admitted)."""
        crowded = ANONYMOUS_CROWDED if self.policy.crowded(self) else None
        size = declared_size(headers)
        given = authorizations(headers)
        return crowded or self.gate(method, path, len(self.connections), size, given)  # type: ignore[misc]

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        """A request pipelined behind another meets the gate here, when its turn comes: at its
        headers it would have taken a slot while it waited, and its refusal could not be
        written before the answer ahead of it. A refusal is sent as the app's error response."""
        extensions: dict[str, Any] = cycle.scope.setdefault("extensions", {})
        if self.gate is not None and ADMITTED not in extensions:
            path = cycle.scope["path"]
            decision = self._decide(cycle.scope["method"], path, cycle.scope["headers"])
            if isinstance(decision, RequestError):
                if self.refused is not None:
                    self.refused(path, decision)
                app = refusal_app(decision)
            else:
                extensions[ADMITTED] = decision
                if not cycle.more_body:  # its body is in already
                    decision.take()
        super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        self._end_framing()
        if self._refusal is None:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head = True
        refusal = self._refusal
        if refusal is None:
            super().on_message_complete()
            slot: Slot | None = self.scope.get("extensions", {}).get(ADMITTED)  # type: ignore[assignment]
            if slot is not None:
                slot.take()  # its body is complete: now it can run, and holds a slot
            return None
        self._refusal = None
        if self.refused is not None:
            self.refused(self._refusal_path, refusal)
        if self.transport.is_closing():
            return
        status, headers, body = response_parts(
            refusal, request_id_of(self.headers), self._refusal_path
        )
        response = response_bytes(status, headers, body)
        close = CLOSE in headers or not self.parser.should_keep_alive()
        # Held for refusal_delay also when the connection closes after it: a client that sends
        # `Connection: close` must not get its refusals faster than one that keeps it open.
        self._held = (response, close)
        if self.refusal_delay > 0:
            self._held_timer = self.loop.call_later(self.refusal_delay, self._release)
        else:
            self._release()

    def _release(self, idle_after: bool = True) -> None:
        """Answer the held refusal now. If the connection is idle after it, it ends in time, as
        uvicorn arms it after a response."""
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        held, self._held = self._held, None
        if held is None or self.transport.is_closing():
            return
        response, close = held
        self.transport.write(response)
        if close:
            self.transport.close()
        elif idle_after:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )


def declared_size(headers: Iterable[tuple[bytes, bytes]]) -> int:
    """The body's Content-Length, or -1 (none, or not a number: chunked)."""
    declared = next((v for k, v in headers if k == b"content-length"), b"")
    return int(declared) if declared.isdigit() else -1


def refusal_app(refusal: RequestError) -> Callable[..., Any]:
    """An ASGI app that answers the gate's refusal as `encode` writes it."""

    async def app(scope: dict[str, Any], receive: Any, send: Callable[..., Any]) -> None:
        request_id = request_id_of(scope["headers"])
        status, headers, body = response_parts(refusal, request_id, scope["path"])
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


class _Collect:
    """A transport that keeps what is written (the response head, while it is held)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport, self.parts = transport, list[bytes]()

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.transport.close()


class _Prefix(_Collect):
    """A transport whose first write goes out after the held head, in the same write."""

    def __init__(self, transport: asyncio.Transport, head: bytes) -> None:
        super().__init__(transport)
        self.head: bytes | None = head

    def write(self, data: bytes) -> None:
        head, self.head = self.head, None
        self.transport.write(head + data if head is not None else data)

    def close(self) -> None:
        if self.head is not None:  # nothing written since the head: it still goes first
            self.transport.write(self.head)
            self.head = None
        self.transport.close()


class OneWriteCycle(RequestResponseCycle):
    """uvicorn's request cycle, writing a response's status line and headers together with its
    first body bytes: one write, one TCP segment and one wake-up of the client, where uvicorn
    writes the head as soon as the app starts its response (two of each). The app's messages
    and uvicorn's own checks and accounting are unchanged: its `send` runs as it is, on a
    transport that holds the head until the body comes."""

    _head: bytes | None = None

    async def send(self, message: Any) -> None:
        transport = self.transport
        if message["type"] == "http.response.start" and not self.response_started:
            self.transport = held = _Collect(transport)  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                self.transport = transport
            self._head = b"".join(held.parts)
            return
        head, self._head = self._head, None
        if head is None:
            return await super().send(message)
        self.transport = prefix = _Prefix(transport, head)  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = transport
            if prefix.head is not None and not transport.is_closing():
                transport.write(prefix.head)  # the body was refused: the head as uvicorn sent it
