"""The supervisor's bookkeeping, step by step, with its worker processes replaced by fakes
whose deaths the test decides: the races of a memory recycle and of workers that cannot start,
which real processes hit only by chance (tests/service/process/test_process.py runs them for
real)."""

from __future__ import annotations

import signal
import socket
import types

import pytest
from prometheus_client import CollectorRegistry, Counter

from bertserve.service.process import supervisor as module
from bertserve.service.process.supervisor import START_ATTEMPTS, Supervisor
from bertserve.service.settings import Settings


class FakeWorker:
    """A worker process: alive once started, until the test kills it or it takes a signal. A
    SIGUSR1 (retire) before it is ready kills it, as the default action does before the
    worker installs its handler."""

    pids = iter(range(10_000, 20_000))

    def __init__(self, target=None, args=(), name="") -> None:
        self.pid, self.name, self.exitcode = next(self.pids), name, None
        self.slot = args[2] if len(args) > 2 else None
        self.alive, self.ready, self.retiring = False, False, False

    def start(self) -> None:
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive

    def die(self, code: int) -> None:
        self.alive, self.exitcode = False, code

    def join(self, timeout=None) -> None:
        pass

    def kill(self) -> None:
        self.die(-signal.SIGKILL)


class Harness:
    """A supervisor of `workers` fake workers, driven a loop turn at a time (`tick`)."""

    def __init__(self, monkeypatch, tmp_path, workers: int) -> None:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        settings = Settings(bundles=tmp_path, workers=workers, max_worker_rss_mb=100)
        self.supervisor = Supervisor(settings)
        self.started: list[FakeWorker] = []
        real = module.SPAWN

        def process(**kwargs):
            worker = FakeWorker(**kwargs)
            self.started.append(worker)
            return worker

        monkeypatch.setattr(
            module, "SPAWN", types.SimpleNamespace(Process=process, Array=real.Array)
        )
        monkeypatch.setattr(module.os, "kill", self.kill)
        self.signals: list[tuple[int, int]] = []
        self.supervisor.lost = Counter("lost", "lost", registry=CollectorRegistry())
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.supervisor.sock = self.sock
        for slot in range(workers):
            self.supervisor.start(slot, self.sock)

    def kill(self, pid: int, sig: int) -> None:
        self.signals.append((pid, sig))
        worker = next(w for w in self.started if w.pid == pid)
        if sig == signal.SIGUSR1:
            if worker.ready:
                worker.retiring = True
            else:
                worker.die(-signal.SIGUSR1)

    def worker(self, slot: int) -> FakeWorker | None:
        return self.supervisor.workers[slot]

    def ready(self, slot: int) -> None:
        worker = self.worker(slot)
        assert worker is not None and worker.alive
        worker.ready = True
        self.supervisor.ready[slot] = 1

    def tick(self, turns: int = 1) -> None:
        for _ in range(turns):
            for slot, due in list(self.supervisor.pending.items()):
                self.supervisor.pending[slot] = (0.0, due[1])  # back-off waited out
            self.supervisor.tick(self.sock)

    def serving(self) -> list[int]:
        """Slots counted for readiness whose process is alive and not retiring."""
        s = self.supervisor
        return [
            slot
            for slot, w in enumerate(s.workers)
            if w is not None and w.alive and not w.retiring and s.shared.counted[slot]
        ]

    def retire_finished(self) -> None:
        for worker in self.started:
            if worker.retiring and worker.alive:
                worker.die(0)


@pytest.fixture
def harness(monkeypatch, tmp_path):
    made: list[Harness] = []

    def make(workers: int) -> Harness:
        made.append(Harness(monkeypatch, tmp_path, workers))
        return made[-1]

    yield make
    for h in made:
        h.sock.close()


def served(h: Harness, workers: int) -> None:
    for slot in range(workers):
        h.ready(slot)
    h.tick()
    assert h.supervisor.shared.served.value and h.serving() == list(range(workers))


def recycle_to_the_end(h: Harness, slot: int) -> int:
    """Worker `slot` asks for a successor; it starts, warms and takes over, and the old one
    retires: the successor's slot."""
    h.supervisor.shared.recycle[slot] = 1
    h.tick()
    assert h.supervisor.recycling is not None, "no successor was started"
    new = h.supervisor.recycling[1]
    h.ready(new)
    h.tick()
    h.retire_finished()
    h.tick()
    return new


def test_a_recycle_with_nothing_killed_hands_the_place_over(harness):
    h = harness(2)
    served(h, 2)
    new = recycle_to_the_end(h, 0)
    assert new == 2 and h.serving() == [1, 2] and h.worker(0) is None
    assert h.supervisor.recycling is None


def test_a_successor_killed_once_ready_but_before_it_took_over_is_started_again(harness):
    """The review's finding: the successor is ready and dies before the supervisor's next turn
    hands it the place. It was taken for a retired worker, the old one was told to retire all
    the same, and the service was left one worker short for good."""
    h = harness(2)
    served(h, 2)
    h.supervisor.shared.recycle[0] = 1
    h.tick()
    old, new = h.supervisor.recycling
    h.ready(new)
    h.worker(new).die(-signal.SIGKILL)
    h.tick()
    assert (h.worker(old).pid, signal.SIGUSR1) not in h.signals  # it still serves
    assert h.serving() == [0, 1]
    assert h.worker(new) is not None and h.worker(new).alive  # a new successor
    h.ready(new)
    h.tick()
    h.retire_finished()
    h.tick()
    assert h.serving() == [1, new]
    assert recycle_to_the_end(h, 1) == 0  # and recycling goes on


def test_an_old_worker_killed_during_its_recycle_leaves_its_place_to_the_successor(harness):
    """The review's finding: the worker being recycled dies (the out-of-memory killer) before
    its successor is ready. It was started again in its slot, then told to retire while still
    starting, which killed it; restarted uncounted, it served outside the books, and no spare
    slot was left: recycling had stopped for good."""
    h = harness(2)
    served(h, 2)
    h.supervisor.shared.in_flight[0] = 3
    h.supervisor.shared.recycle[0] = 1
    h.tick()
    old, new = h.supervisor.recycling
    h.worker(old).die(-signal.SIGKILL)
    h.tick()
    assert h.supervisor.lost._value.get() == 3
    h.ready(new)
    h.tick(3)
    h.retire_finished()
    h.tick()
    assert h.serving() == [1, new]
    alive = [w for w in h.supervisor.workers if w is not None and w.alive]
    assert len(alive) == 2  # nobody outside the books
    assert all(sig != signal.SIGUSR1 for _, sig in h.signals)
    assert recycle_to_the_end(h, 1) == old  # the freed slot is the next spare


def test_a_worker_killed_while_it_retires_counts_its_requests_lost(harness):
    """A retiring worker drains what it admitted; killed on the way, those clients get no
    answer: counted, as a serving worker's are. One that retires cleanly loses nothing."""
    h = harness(2)
    served(h, 2)
    recycle_to_the_end(h, 0)  # worker 0 retired with 0
    assert h.supervisor.lost._value.get() == 0
    h.supervisor.shared.recycle[1] = 1
    h.tick()
    old, new = h.supervisor.recycling
    h.ready(new)
    h.tick()  # the successor takes over; worker 1 is told to retire
    assert h.worker(old).retiring
    h.supervisor.shared.in_flight[old] = 4
    h.worker(old).die(-signal.SIGKILL)
    h.tick()
    assert h.supervisor.lost._value.get() == 4
    assert h.worker(old) is None and h.serving() == [0, 2]


def test_a_worker_that_fails_every_start_with_none_ready_stops_the_service(harness, caplog):
    """Served once, then every worker dead and each new one failing before it is ready (a
    broken mount, memory gone): after START_ATTEMPTS tries in a row the supervisor stops, with
    one line saying why, instead of retrying every 30 s forever."""
    h = harness(1)
    served(h, 1)
    h.worker(0).die(-signal.SIGKILL)  # it served: replaced at once
    h.tick()
    for attempt in range(START_ATTEMPTS):
        assert not h.supervisor.stopping, attempt
        h.worker(0).die(1)
        h.tick(2)
    assert h.supervisor.stopping and h.supervisor.failed
    stops = [r.getMessage() for r in caplog.records if "stopping" in r.getMessage()]
    assert len(stops) == 1, stops
    assert f"failed {START_ATTEMPTS} starts in a row" in stops[0]
    assert "no worker is ready" in stops[0]


def test_a_worker_that_fails_its_starts_beside_a_ready_one_is_retried(harness):
    h = harness(2)
    served(h, 2)
    h.worker(0).die(-signal.SIGKILL)
    h.tick()
    for _ in range(START_ATTEMPTS + 2):
        h.worker(0).die(1)
        h.tick(2)
    assert not h.supervisor.stopping
    assert h.worker(0) is not None and h.worker(0).alive  # tried again
    assert h.supervisor.failures[0] == START_ATTEMPTS + 2
