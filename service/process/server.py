"""Running the app: the JSON log format, a uvicorn server that drains on SIGTERM and says when
it is ready, and one serving process (`run_worker`), alone or as one of the supervisor's."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import resource
import signal
import socket
import struct
import sys
import time
from types import FrameType

import uvicorn

from bertserve.service.http.protocol import Connections, guarded_protocol
from bertserve.service.logs import configure_logging
from bertserve.service.process.memory import rss_mb
from bertserve.service.settings import Settings


def ready_facts(state, host: str, port: int) -> dict:
    """What a person needs once the service is ready: where it is, what it serves, on what."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{port}"
    from bertserve.runtime.tasks import TASKS

    serving = state.serving()
    served = [t for t in TASKS.values() if t.capability in serving]
    task = next((t for t in served if t.capability == "classify"), served[0])
    body = json.dumps(task.example)
    return {
        "event": "ready",
        "url": url,
        "listening": f"{host}:{port}",
        "docs": f"{url}/docs",
        "models": serving,
        "providers": sorted({m.engine.provider for m in state.models.values()}),
        "example": f"curl -s {url}{task.path} -H 'content-type: application/json' -d '{body}'",
    }


def ready_text(facts: dict) -> str:
    width = max(len("API docs"), *map(len, facts["models"]))
    lines = [
        f"bertserve is ready at {facts['url']} (listening on {facts['listening']})",
        f"  {'API docs':<{width}}  {facts['docs']}",
        f"  {'provider':<{width}}  {', '.join(facts['providers'])}",
        *(
            f"  {task:<{width}}  {names[0]} (default)"
            + (f", {', '.join(names[1:])} (?model=NAME)" if names[1:] else "")
            for task, names in facts["models"].items()
        ),
        f"  {'try':<{width}}  {facts['example']}",
    ]
    return "\n".join(lines)


# A retiring worker closes a connection whose client has sent nothing for this long.
RETIRE_QUIET_S = 2.0

# How long a drain waits for the connections it took from the accept queue to send their
# request (and get the draining 503): a client that connected just before the listener closed
# sends at once; one that sends nothing is closed when this ends.
SWEEP_WAIT_S = 5.0

# New connections a worker takes each time its listening socket is ready: up to its fair share
# of all the workers' connections, the waiting ones included (accept_share), at most this many.
# libuv, under uvloop, accepts one connection per event-loop iteration (libuv 1.45, PR #3696),
# and a loaded worker's iteration takes milliseconds (p90 11-17 ms in a flood), so a storm of
# new connections waited in the kernel's accept queue: in the student's cold-start flood,
# 2,048 connections opened in half a second waited 1.7 s at the median before a worker accepted
# them (docs/performance.md).
# A share, not all that waits, so a fast worker does not take what the others should (a first
# version that took all split wrk's 32 connections as unevenly as 22 / 10 and served 0.60-0.65x
# at 32 connections in its one A/B); bounded, so a storm cannot hold a loop from the requests of
# the connections it already has.
ACCEPT_BURST = 64
# How long the acceptor steps aside when accept() fails for want of descriptors or memory
# (libuv's own accept, which stays on, answers that case by closing the connection).
ACCEPT_BACKOFF_S = 0.1


def accept_share(waiting: int, slot: int | None = None, counts=None) -> int:
    """How many of the `waiting` connections a worker takes now: alone on its socket, all of them
    (at most ACCEPT_BURST); beside other workers, up to its fair share of all their connections,
    the waiting ones included, so one that is ahead leaves them to the others. `counts`: every
    worker's open connections, its own (`slot`) current."""
    if counts is None or slot is None:
        return min(ACCEPT_BURST, waiting)
    fair = -(-(sum(counts) + waiting) // len(counts))
    return max(0, min(ACCEPT_BURST, waiting, fair - counts[slot]))


def accept_queue_length(listener: socket.socket) -> int | None:
    """Connections waiting in a listening TCP socket's accept queue (Linux reports it as
    `tcpi_unacked` of TCP_INFO, what `ss -l` shows as Recv-Q); None where it cannot be read."""
    try:
        info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
    except (OSError, AttributeError):  # not TCP, or not Linux
        return None
    return struct.unpack_from("I", info, 24)[0] if len(info) >= 28 else None


class DrainingServer(uvicorn.Server):
    """uvicorn, with a first SIGTERM that drains instead of cutting in-flight requests, and a
    line for people (or one structured log line, off a terminal) once every model is warm."""

    def __init__(
        self,
        config: uvicorn.Config,
        state,
        drain_timeout: float,
        slot: int | None = None,
        shared=None,
    ) -> None:
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self.slot, self.shared = slot, shared  # service.process.supervisor.Shared, with the others
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list[socket.socket] = []
        self._accepting: set[int] = set()  # listeners' descriptors the acceptor watches
        self._adopting: set[asyncio.Task] = set()  # accepted, their transports being made

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            # A second handle on each listening socket: at the end of a drain the server's own
            # is closed (no more accepting) while this one keeps the kernel's accept queue open
            # for the sweep (_take_backlog).
            self._listeners = [
                socket.fromfd(s.fileno(), s.family, s.type)
                for server in self.servers
                for s in server.sockets
            ]
            loop = asyncio.get_running_loop()
            for listener in self._listeners:
                if accept_queue_length(listener) is not None:
                    self._watch(listener)
            if self.shared is not None:
                self._tasks.append(loop.create_task(self._publish_readiness()))
            if self.slot in (None, 0) and not self.state.warm_first:  # one speaks for all
                self._tasks.append(loop.create_task(self._announce()))

    # --- accepting in bursts (ACCEPT_BURST) -----------------------------------------------------

    def _protocol(self) -> asyncio.Protocol:
        config = self.config
        return config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=self.server_state, app_state=self.lifespan.state
        )

    def _watch(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept_burst, listener)
        self._accepting.add(listener.fileno())

    def _unwatch(self, listener: socket.socket) -> None:
        fd = listener.fileno()
        if fd in self._accepting:
            self._accepting.discard(fd)
            asyncio.get_running_loop().remove_reader(fd)

    def _accept_burst(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        self._publish_connections()
        # 0 or unreadable: libuv's accept may have taken it meanwhile; try one all the same.
        waiting = accept_queue_length(listener) or 1
        counts, mine = (
            self.shared.active_connections(self.slot)
            if self.shared is not None and self.slot is not None
            else (None, None)
        )
        for _ in range(accept_share(waiting, mine, counts)):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return  # the queue is empty (or libuv's accept took the last one)
            except ConnectionAbortedError:
                continue
            except OSError:  # out of descriptors or memory: ready again at once, so step aside
                self._unwatch(listener)
                loop.call_later(ACCEPT_BACKOFF_S, self._rewatch, listener)
                return
            task = loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _publish_connections(self) -> None:
        """This worker's open connections (the ones being set up included), in its slot of the
        shared counts the workers split new connections by."""
        if self.shared is not None and self.slot is not None:
            mine = len(self.server_state.connections) + len(self._adopting)
            self.shared.connections[self.slot] = mine

    def _rewatch(self, listener: socket.socket) -> None:
        if listener.fileno() >= 0 and not self.state.draining and not self.should_exit:
            self._watch(listener)

    async def _adopt(self, conn: socket.socket) -> asyncio.BaseTransport | None:
        """An accepted connection served as uvicorn serves its own: the same protocol, counted
        in the same connections (so a drain and the shutdown reach it)."""
        try:
            transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
                self._protocol, conn
            )
        except OSError:  # reset before it could be set up
            conn.close()
            return None
        return transport

    def stop_accepting(self) -> None:
        """This process accepts no more connections (other holders of the socket may)."""
        for server in self.servers:
            server.close()
        for listener in self._listeners:
            self._unwatch(listener)

    async def shutdown(self, sockets=None) -> None:
        self.stop_accepting()
        await super().shutdown(sockets)

    async def _publish_readiness(self) -> None:
        """This worker's own readiness, in its slot: every worker's /health/ready reads all.
        And once a second its resident memory: past max_worker_rss_mb it asks the supervisor
        for a successor (service.process.supervisor.Supervisor.recycle)."""
        assert self.shared is not None and self.slot is not None
        ceiling = self.state.settings.max_worker_rss_mb
        for tick in itertools.count():
            self.shared.ready[self.slot] = 1 if self.state.ready_here else 0
            self._publish_connections()  # closed ones too, between the acceptor's wake-ups
            if ceiling and tick % 20 == 0 and not self.shared.recycle[self.slot]:
                resident = rss_mb()
                if resident > ceiling:
                    logging.getLogger("bertserve").warning(
                        "%.0f MB resident, over max_worker_rss_mb %d: asking for a successor",
                        resident,
                        ceiling,
                    )
                    self.shared.recycle[self.slot] = 1
            await asyncio.sleep(0.05)

    def retire(self) -> None:
        """SIGUSR1: a successor serves in this worker's place. Accept nothing more, answer what
        was admitted and what already waits on this worker's connections (each closed after
        its answer), close the idle ones, then exit. Unlike a drain, nothing is refused and
        the shared accept queue is left to the other workers."""
        if self._loop is None or self.state.retiring or self.state.draining:
            return
        self.state.retiring = True
        logging.getLogger("bertserve").info("retiring: a successor serves in this one's place")
        loop = self._loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self._retire()))

    async def _retire(self) -> None:
        """Each answer now closes its connection (app.RETIRING_HEADERS), so a busy client moves
        to another worker after its next answer, having been told. A connection closes here
        only once its client has been quiet for RETIRE_QUIET_S: closing one the instant a
        request is sent on it resets that request (a client that sent back to back lost one
        in CI so)."""
        self.stop_accepting()
        deadline = time.monotonic() + self.drain_timeout
        while time.monotonic() < deadline:
            for connection in list(self.server_state.connections):
                quiet = getattr(
                    connection, "quiet_for", None
                )  # service.http.protocol's connections
                if quiet is None or quiet() > RETIRE_QUIET_S:
                    connection.shutdown()  # one with a request waiting in its socket reads it
            if not self.server_state.connections and self.state.unanswered == 0:
                break
            await asyncio.sleep(0.05)
        self.should_exit = True

    async def _announce(self) -> None:
        while not self.state.ready:
            if self.should_exit or self.state.draining:
                return
            await asyncio.sleep(0.05)
        port = self.servers[0].sockets[0].getsockname()[1]  # the real one, also for --port 0
        facts = ready_facts(self.state, self.config.host, port)
        if sys.stdout.isatty():
            print(ready_text(facts), flush=True)  # noqa: T201
        else:
            logging.getLogger("bertserve").info("ready", extra={"fields": facts})

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining and sig == signal.SIGTERM and self.shared is not None:
            # A supervisor's worker gets SIGTERM twice when the whole process group is
            # signalled (systemd, a shell's job control): once itself, once passed on. The
            # drain is already under way; uvicorn would stop it, and re-raise the signal at
            # exit (exit status -15, which fails the supervisor's).
            return None
        if self.state.draining or self._loop is None:
            return super().handle_exit(sig, frame)
        self.state.draining = True
        logging.getLogger("bertserve").info(
            "signal %d: draining %d in-flight requests", sig, self.state.in_flight
        )
        loop = self._loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        """Admitted requests finish while new ones are answered 503 with `Connection: close`
        (ServiceState.admit) on a listener that stays open; then the accept queue is taken
        and answered too, and only then does the listener close, so a client is reset only if
        its connection completes in the instant between the last accept and the close. A
        process still starting has accepted nothing: it exits once its start-up ends."""
        if not self.started:
            self.should_exit = True
            return
        deadline = time.monotonic() + self.drain_timeout
        while self.state.unanswered > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        taken = await self._take_backlog(deadline)
        logging.getLogger("bertserve").info(
            "drained: %d in flight left, %d connections taken from the accept queue and refused",
            self.state.in_flight,
            taken,
        )
        self.should_exit = True

    async def _take_backlog(self, deadline: float) -> int:
        self.stop_accepting()
        transports = []
        for listener in self._listeners:
            listener.setblocking(False)
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:  # BlockingIOError: the queue is empty
                    break
                transport = await self._adopt(conn)
                if transport is not None:
                    transports.append(transport)
            listener.close()
        # Their requests get the draining 503 and the protocol closes them; a client that
        # connected and sends nothing is closed at the deadline (or by the shutdown).
        wait_until = min(deadline, time.monotonic() + SWEEP_WAIT_S)
        while any(not t.is_closing() for t in transports) and time.monotonic() < wait_until:
            await asyncio.sleep(0.01)
        return len(transports)


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def warn_if_exposed(settings: Settings) -> None:
    """Loud, not fatal: inside a container the process always listens on 0.0.0.0, and whether
    that is exposed is the port mapping's or the NetworkPolicy's call (docs/security.md)."""
    if settings.host not in LOOPBACK and not settings.keys():
        logging.getLogger("bertserve").warning(
            "listening on %s without an API key: anyone who can reach port %d can use the "
            "models; set BERTSERVE_API_KEYS, or keep the port private (docs/security.md)",
            settings.host,
            settings.port,
        )


def raise_open_files(connections: int) -> None:
    """Each connection is a file descriptor: lift the soft limit towards the hard one so that
    `max_connections` fit (with room for models, logs and the listener), or say it cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + 256
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        logging.getLogger("bertserve").warning(
            "open-file limit %d (hard) is below BERTSERVE_MAX_CONNECTIONS %d + 256: past it new "
            "connections wait in the kernel's accept queue instead of getting a 503",
            hard,
            connections,
        )


def uvicorn_config(app, settings: Settings) -> uvicorn.Config:
    """How the app is served: httptools with the guarded protocol (header timeout, refusals
    before a task exists), uvloop where installed, no uvicorn access log (the app logs)."""
    from bertserve.service.http.app import count_refusal

    state = app.state.service
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=guarded_protocol(
            settings.header_timeout_s,
            state.admit,
            functools.partial(count_refusal, state),
            settings.refusal_delay_ms / 1000,
            state.metrics.open_connections.inc,
            settings.max_header_bytes,
            Connections(
                # admin keys mark a connection as keyed, where API keys make others anonymous
                settings.keys() + (settings.admin_key_set() if settings.keys() else ()),
                settings.max_anonymous_connections,
                settings.max_connections,
            ),
        ),
        loop="auto",
        access_log=False,
        # Nothing reads the client's address (the access log has none), so uvicorn's rewrite of
        # it from X-Forwarded-For, a middleware layer a request, is left out.
        proxy_headers=False,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
        # Annotated int, used only as loop.call_later's delay: a float is what it takes.
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
    )


def run_worker(
    settings: Settings,
    sockets: list[socket.socket] | None = None,
    slot: int | None = None,
    shared=None,
    warm_first: bool = False,
    engine_address: str = "",
) -> int:
    """Serve until SIGTERM has drained (or SIGUSR1 retired it): alone (binding the port
    itself), or as worker `slot` of the supervisor's, on its shared listening socket, with
    every worker's readiness in `shared` (service.process.supervisor.Shared). `warm_first`: accept
    no connection until every model is warm (other workers serve meanwhile). `engine_address`:
    the engine process's socket, where one runs the models. Returns the exit status."""
    from bertserve.runtime.batching import Activity
    from bertserve.service.http.app import create_app

    configure_logging(settings.log_level)
    if slot is None:
        warn_if_exposed(settings)
    app = create_app(settings)
    state = app.state.service
    state.engine_address = engine_address
    if shared is not None and slot is not None:
        state.worker = slot
        state.peers_ready = shared.all_ready
        state.activity = Activity(shared.in_flight, slot)
        state.receivers = shared.receiving
        state.warm_first = warm_first
        state.control.board = shared.board(slot)
    raise_open_files(settings.max_connections)
    config = uvicorn_config(app, settings)
    server = DrainingServer(config, state, settings.drain_timeout_s, slot, shared)
    if shared is not None:
        signal.signal(signal.SIGUSR1, lambda sig, frame: server.retire())
    elif settings.max_worker_rss_mb:
        logging.getLogger("bertserve").warning(
            "max_worker_rss_mb is set, but this process has no supervisor to replace it "
            "(bertserve serve starts one whenever max_worker_rss_mb is set)"
        )
    server.run(sockets=sockets)
    return 0 if server.started else 1
