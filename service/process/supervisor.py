"""Several serving processes on one port: the CPU topology (docs/architecture.md).

One event loop cannot keep a fast model busy (it tokenises, parses and answers every request),
so the supervisor binds the port once and starts `workers` processes that all accept on it,
each with its own ONNX Runtime sessions and a share of the cores. It:

- keeps every worker's readiness in shared memory: until the service is first ready, any
  worker's /health/ready is true only when all of them are ready; from then on a worker
  started in another's place (a replacement, a recycled worker's successor) accepts no
  connection until it is warm, so each worker that answers speaks for itself and a dead
  worker does not take the pod out of rotation;
- points prometheus_client's multiprocess mode at one directory, so that any worker's /metrics
  is the whole service (counters summed, histograms merged, gauges as service.metrics says);
- replaces a worker that dies (and forgets its live gauges; the requests it had in flight are
  counted in `bertserve_worker_lost_requests_total`); a replacement that dies before it is
  ready is started again with back-off (RETRY_S), the others serving meanwhile. A worker that
  dies before the service was first ready (every worker at once) stops it: a new one would
  fail the same way, and the orchestrator should see it; so does one that fails
  START_ATTEMPTS starts in a row while no other worker is ready;
- replaces a worker whose memory passed `max_worker_rss_mb` without a gap: the new one starts in
  a spare slot, and only once it is ready does the old one stop accepting, finish what it
  admitted and close its connections (SIGUSR1, `server.DrainingServer.retire`). Either may die
  on the way: an old worker killed first leaves its place to the successor at once, a
  successor killed before it took over is started again;
- on SIGTERM, passes the signal on, lets go of the port (the workers answer its accept queue
  and close it as they finish) and waits for every worker to drain.

With `engine_process` (the GPU topology) it first starts one engine process that runs every
model for all workers (service.process.engine_server), gives the workers its socket, counts
its readiness as one more slot (no worker is ready while it is not), replaces it if it dies,
and stops it after the workers have drained.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from bertserve.service.logs import configure_logging
from bertserve.service.process.server import warn_if_exposed
from bertserve.service.settings import Settings

if TYPE_CHECKING:
    from bertserve.service.control import Board

log = logging.getLogger("bertserve.supervisor")
SPAWN = multiprocessing.get_context("spawn")  # no fork: the parent holds no models or threads
# Back-off before a worker that died starting is started again: doubling from the first, at
# most the last (the out-of-memory killer that took it may take the next one too).
RETRY_S = (0.5, 30.0)
# A worker that fails this many starts in a row while no other is ready stops the service.
START_ATTEMPTS = 5


def stop_with_the_supervisor() -> None:
    """A worker or engine process would outlive a supervisor that was killed outright (the OOM
    killer, `kill -9`), serving on with nobody to replace it or drain it, and holding the port.
    A thread waits on the parent's sentinel instead and sends this process SIGTERM: it drains
    what it holds and exits, and the port closes with the last worker."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        log.warning("the supervisor (pid %s) is gone: draining and exiting", parent.pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def engine_process_main(values: dict[str, Any], address: str, ready: Any) -> None:
    from bertserve.service.process.engine_server import engine_main

    stop_with_the_supervisor()
    engine_main(values, address, ready)


def worker_main(
    values: dict[str, Any],
    sock: socket.socket,
    slot: int,
    shared: Shared,
    warm_first: bool,
    engine_address: str,
) -> None:
    from bertserve.service.process.server import run_worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which drains
    stop_with_the_supervisor()
    raise SystemExit(
        run_worker(Settings(**values), [sock], slot, shared, warm_first, engine_address)
    )


@dataclass
class Shared:
    """What the supervisor and its workers share, a slot a worker (one of them spare): each
    one's readiness (then the engine process's), open connections (each accepts its share of
    new ones: service.process.server.ACCEPT_BURST), whether readiness counts it, and its call for a
    successor (over max_worker_rss_mb), and its requests in flight (a lone request's call takes
    every core only when no other is in flight: runtime.batching.Activity)."""

    ready: Any
    connections: Any
    counted: Any
    recycle: Any
    in_flight: Any
    served: Any  # the service has been ready once: each worker's readiness is its own
    # Model management (service.control.Board): the wanted set's newest generation, the one
    # each slot has reached, and the directory of the wanted set and the workers' reports.
    generation: Any
    reached: Any
    receiving: Any  # its admitted requests still sending their bodies (the lost count's too)
    control: str = ""

    @classmethod
    def create(cls, slots: int, engine: bool) -> Shared:
        return cls(
            SPAWN.Array("b", slots + engine, lock=False),
            SPAWN.Array("i", slots, lock=False),
            SPAWN.Array("b", slots, lock=False),
            SPAWN.Array("b", slots, lock=False),
            SPAWN.Array("i", slots, lock=False),
            SPAWN.Value("b", 0, lock=False),
            SPAWN.Value("i", 0, lock=False),
            SPAWN.Array("i", slots, lock=False),
            SPAWN.Array("i", slots, lock=False),
        )

    def board(self, slot: int) -> Board:
        """Worker `slot`'s view of the model management board."""
        from bertserve.service.control import Board

        return Board(
            self.control,
            slot,
            self.generation,
            self.reached,
            lambda i: bool(self.counted[i] and self.ready[i]),
        )

    def all_ready(self) -> bool:
        """What a ready worker adds to its own readiness: the engine process, if there is one,
        is ready, and, until the service was first ready, so is every counted worker. After
        that a worker started in another's place accepts nothing until it is warm
        (`warm_first`), so a worker that answers is one that serves."""
        slots = len(self.counted)
        engine = all(self.ready[slots:])
        if self.served.value:
            return engine
        workers = all(r or not c for r, c in zip(self.ready[:slots], self.counted, strict=True))
        if workers and engine:
            self.served.value = 1
        return workers and engine

    def active_connections(self, slot: int) -> tuple[list[int], int]:
        """The open connections of the counted workers and `slot`, and `slot`'s index there."""
        mine = [i for i in range(len(self.counted)) if self.counted[i] or i == slot]
        return [self.connections[i] for i in mine], mine.index(slot)


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.count = settings.worker_count
        self.slots = self.count + 1  # one spare: a recycled worker's successor starts there
        self.shared = Shared.create(self.slots, settings.engine_process)
        self.ready = self.shared.ready
        self.engine: Any = None
        self.engine_ready: Any = None
        self.engine_served = False
        self.engine_address = ""
        self.workers: list[Any] = [None] * self.slots
        self.served = [False] * self.slots  # has this slot's current process ever been ready?
        self.failures = [0] * self.slots  # its processes that died starting, in a row
        self.pending: dict[int, tuple[float, bool]] = {}  # slot -> (start it at, counted)
        self.lost: Any = None  # the counter of requests a dead worker had in flight
        self.recycling: tuple[int, int] | None = None  # (old slot, its successor's)
        self.stopping = False
        self.failed = False
        self.sock: socket.socket | None = None

    def bind(self) -> socket.socket:
        host, port = self.settings.host, self.settings.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
        return sock

    def values(self) -> dict[str, Any]:
        """The settings, as a spawned process rebuilds them."""
        values = self.settings.model_dump(exclude_unset=False)
        values = {
            k: (v.get_secret_value() if hasattr(v, "get_secret_value") else v)
            for k, v in values.items()
        }
        return values

    def start_engine(self, directory: str) -> None:
        self.ready[self.slots] = 0
        self.engine_served = False
        self.engine_address = os.path.join(directory, "engine.sock")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.engine_address)  # a dead engine's
        self.engine_ready = SPAWN.Event()
        self.engine = SPAWN.Process(
            target=engine_process_main,
            args=(self.values(), self.engine_address, self.engine_ready),
            name="bertserve-engine",
        )
        self.engine.start()
        log.info("engine process started (pid %d)", self.engine.pid)

    def watch_engine(self, directory: str) -> bool:
        """Readiness of the engine process into its slot; a dead one is replaced (one that died
        before it was ever ready stops the service). False: stop."""
        if self.engine_ready.is_set():
            self.engine_served = True
            self.ready[self.slots] = 1
        if self.engine.is_alive():
            return True
        self.ready[self.slots] = 0
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(self.engine.pid)
        if not self.engine_served:
            log.error(
                "the engine process exited with %s before it was ready: stopping",
                self.engine.exitcode,
            )
            return False
        log.error("the engine process died with %s: replacing it", self.engine.exitcode)
        self.start_engine(directory)
        return True

    def start(self, slot: int, sock: socket.socket, counted: bool = True) -> None:
        """A worker in `slot`; `counted`: readiness waits for it (a successor is counted only
        once it is ready). While another worker serves, the new one takes no connection until
        it is warm; alone, it answers the probes (live, not ready) as it warms."""
        self.pending.pop(slot, None)
        self.ready[slot] = 0
        self.shared.connections[slot] = 0
        self.shared.counted[slot] = int(counted)
        self.shared.recycle[slot] = 0
        # What a worker killed with requests in flight, or bodies arriving, left.
        self.shared.in_flight[slot] = self.shared.receiving[slot] = 0
        self.served[slot] = False
        values = self.values()
        values["port"] = sock.getsockname()[1]
        warm_first = any(
            self.ready[i] and self.workers[i] is not None and self.workers[i].is_alive()
            for i in range(self.slots)
            if i != slot
        )
        process = SPAWN.Process(
            target=worker_main,
            args=(values, sock, slot, self.shared, warm_first, self.engine_address),
            name=f"bertserve-{slot}",
        )
        process.start()
        self.workers[slot] = process
        log.info("worker %d started (pid %d)", slot, process.pid)

    def run(self) -> int:
        configure_logging(self.settings.log_level)
        warn_if_exposed(self.settings)
        metrics_dir = tempfile.mkdtemp(prefix="bertserve-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the workers inherit it
        self.lost = lost_requests_counter()
        sock = self.sock = self.bind()
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        if self.settings.engine_process:
            log.info(
                "serving on %s:%d with %d worker%s and one engine process "
                "(ONNX Runtime threads: %d)",
                self.settings.host,
                sock.getsockname()[1],
                self.count,
                "" if self.count == 1 else "s",
                self.settings.engine_options(device=True).threads,
            )
        else:
            log.info(
                "serving on %s:%d with %d workers, %d ONNX Runtime threads each",
                self.settings.host,
                sock.getsockname()[1],
                self.count,
                self.settings.threads,
            )
        engine_dir = tempfile.mkdtemp(prefix="bertserve-engine-")  # mode 0700: this user's
        self.shared.control = tempfile.mkdtemp(prefix="bertserve-models-")  # service.control
        try:
            if self.settings.engine_process:
                self.start_engine(engine_dir)
                while not self.engine_ready.is_set():  # the workers connect to it as they load
                    if self.stopping or not self.watch_engine(engine_dir):
                        self.stop_engine()
                        return 0 if self.stopping else 1
                    time.sleep(0.05)
                self.watch_engine(engine_dir)
            for slot in range(self.count):
                self.start(slot, sock)
            while not self.stopping:
                self.tick(sock)
                engine_lost = self.engine is not None and not self.watch_engine(engine_dir)
                if engine_lost and not self.stopping:
                    self.failed = True
                    self.on_signal(signal.SIGTERM, None)
                time.sleep(0.2)
            status = self.drain()
            self.stop_engine()
            return 1 if self.failed else status
        finally:
            sock.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)
            shutil.rmtree(self.shared.control, ignore_errors=True)
            shutil.rmtree(engine_dir, ignore_errors=True)

    def tick(self, sock: socket.socket) -> None:
        """One turn of the supervisor's loop over its workers: readiness noted, the dead
        replaced, the pending started, a recycle moved on."""
        self.shared.all_ready()  # marks the service served once every worker is
        for slot, process in enumerate(self.workers):
            if self.ready[slot] and not self.served[slot]:
                self.served[slot], self.failures[slot] = True, 0
            if not self.stopping and process is not None and not process.is_alive():
                self.replace(slot, process, sock)
        now = time.monotonic()
        for slot, (due, counted) in list(self.pending.items()):
            if now >= due and not self.stopping:
                self.start(slot, sock, counted)
        if not self.stopping:
            self.recycle(sock)

    def stop_engine(self) -> None:
        """After the workers: SIGTERM, then the engine waits for their connections to close."""
        if self.engine is None or not self.engine.is_alive():
            return
        os.kill(self.engine.pid, signal.SIGTERM)
        self.engine.join(self.settings.drain_timeout_s + 10)
        if self.engine.is_alive():
            self.engine.kill()
        log.info("engine process exited with %s", self.engine.exitcode)

    def recycle(self, sock: socket.socket) -> None:
        """A worker over its memory ceiling gets a successor in the spare slot; once that is
        ready, it takes the old one's place in readiness and the old one retires."""
        shared = self.shared
        if self.recycling is None:
            # The spare slot is free again once the last worker retired has exited.
            spare = next(
                (i for i, p in enumerate(self.workers) if p is None and i not in self.pending),
                None,
            )
            for slot, process in enumerate(self.workers):
                if spare is None:
                    return
                alive = process is not None and process.is_alive()
                if shared.counted[slot] and shared.recycle[slot] and alive:
                    log.warning(
                        "worker %d (pid %d) is over %d MB resident: starting its successor",
                        slot,
                        process.pid,
                        self.settings.max_worker_rss_mb,
                    )
                    self.start(spare, sock, counted=False)
                    self.recycling = (slot, spare)
                    return
            return
        old, new = self.recycling
        if self.ready[new]:
            shared.counted[new], shared.counted[old] = 1, 0
            self.recycling = None
            process = self.workers[old]
            if process is not None and process.is_alive():
                log.info("worker %d is ready: worker %d (pid %d) retires", new, old, process.pid)
                os.kill(process.pid, signal.SIGUSR1)

    def replace(self, slot: int, process: Any, sock: socket.socket) -> None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(process.pid)
        shared = self.shared
        # What its clients lost: requests admitted, answered or still sending their bodies.
        lost = shared.in_flight[slot] + shared.receiving[slot]
        old, new = self.recycling or (-1, -1)
        if slot == old:
            # Killed before its successor took over: the successor takes its place now (counted,
            # so readiness waits for it, and started again like any worker if it dies), and
            # this slot is the spare. Started again here, it would be told to retire while
            # still starting, and would leave no spare: recycling stopped for good.
            self.count_lost(lost)
            log.error(
                "worker %d (pid %d) died with %s and %d requests in flight while its successor "
                "(worker %d) started: the successor takes its place",
                slot,
                process.pid,
                process.exitcode,
                lost,
                new,
            )
            self.workers[slot], self.recycling = None, None
            self.ready[slot] = shared.counted[slot] = shared.recycle[slot] = 0
            shared.counted[new] = 1
            return
        if slot == new and self.served[slot]:
            # Ready, and dead before the supervisor's next turn handed it the place: not a
            # retired worker. Its old one goes on serving and gets a new successor.
            self.count_lost(lost)
            log.error(
                "worker %d (pid %d), the successor of worker %d, died with %s once ready: "
                "starting another",
                slot,
                process.pid,
                old,
                process.exitcode,
            )
            self.start(slot, sock, counted=False)
            return
        if not shared.counted[slot] and self.served[slot]:  # retired: its slot is spare
            log.info("worker %d (pid %d) retired with %s", slot, process.pid, process.exitcode)
            if process.exitcode != 0:  # killed while it drained: its clients got no answer
                self.count_lost(lost)
            self.workers[slot] = None
            return
        if not self.served[slot]:
            if not self.shared.served.value:
                # The service was never ready: a new one would fail the same way.
                log.error(
                    "worker %d (pid %d) exited with %s before it was ready: stopping",
                    slot,
                    process.pid,
                    process.exitcode,
                )
                self.failed = True
                self.on_signal(signal.SIGTERM, None)
                return
            # Others serve: the out-of-memory killer, most likely, which recycling meets when
            # memory is tight. Try again, with back-off, while they go on; with none left
            # ready, START_ATTEMPTS times in a row, then the orchestrator is told (exit 1).
            self.failures[slot] += 1
            if self.failures[slot] >= START_ATTEMPTS and not any(
                self.ready[i] and p is not None and p.is_alive()
                for i, p in enumerate(self.workers)
                if i != slot
            ):
                log.error(
                    "worker %d (pid %d) exited with %s before it was ready: it failed %d "
                    "starts in a row and no worker is ready: stopping",
                    slot,
                    process.pid,
                    process.exitcode,
                    self.failures[slot],
                )
                self.workers[slot] = None
                self.failed = True
                self.on_signal(signal.SIGTERM, None)
                return
            first, most = RETRY_S
            delay = min(most, first * 2 ** min(self.failures[slot] - 1, 16))
            log.error(
                "worker %d (pid %d) exited with %s before it was ready: starting it again in "
                "%.1f s",
                slot,
                process.pid,
                process.exitcode,
                delay,
            )
            self.workers[slot] = None
            self.ready[slot] = self.shared.recycle[slot] = 0  # what the dead one left
            self.pending[slot] = (time.monotonic() + delay, bool(self.shared.counted[slot]))
            return
        self.count_lost(lost)
        log.error(
            "worker %d (pid %d) died with %s and %d requests in flight: replacing it",
            slot,
            process.pid,
            process.exitcode,
            lost,
        )
        self.start(slot, sock)

    def count_lost(self, requests: int) -> None:
        if self.lost is not None and requests > 0:
            self.lost.inc(requests)

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.stopping:  # a second signal: stop now
            for process in [*self.workers, self.engine]:
                if process is not None and process.is_alive():
                    process.kill()
            return
        self.stopping = True
        # The workers hold the listener while they drain; the last to finish takes the accept
        # queue and closes it (server.DrainingServer._drain). Held here as well, it would stay
        # open with no one accepting, and what queued would be reset at exit.
        if self.sock is not None:
            self.sock.close()
        log.info("signal %d: draining %d workers", sig, self.count)
        for process in self.workers:  # at once: each stops admitting and drains its own work
            if process is not None and process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    def drain(self) -> int:
        deadline = time.monotonic() + self.settings.drain_timeout_s + 10
        for process in self.workers:
            if process is not None:
                process.join(max(0.0, deadline - time.monotonic()))
        # A successor still starting when the signal came ends by it, having served nothing; so
        # may a retired worker (replaced for its memory) still exiting when it came, its
        # connections already finished.
        ended = [
            (p.exitcode, not self.shared.counted[i])
            for i, p in enumerate(self.workers)
            if p is not None and self.served[i]
        ]
        log.info("workers exited with %s", [code for code, _ in ended])
        fine = [code == 0 or (code == -signal.SIGTERM and retired) for code, retired in ended]
        return 0 if all(fine) else 1


def lost_requests_counter() -> Any:
    """`bertserve_worker_lost_requests_total`, kept by the supervisor in the workers' metrics
    directory, so any worker's /metrics shows it. prometheus_client chose its value class when
    it was imported, maybe before the directory was set: the multiprocess one is asked for."""
    from prometheus_client import Counter, values

    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.MultiProcessValue()
    return Counter(
        "bertserve_worker_lost_requests",
        "Requests a worker had in flight when it died (their clients got no answer)",
        registry=None,
    )
