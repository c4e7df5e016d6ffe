"""Models managed while the service runs (`BERTSERVE_MODEL_CONTROL=explicit`): load, replace and
unload a bundle of the repository (the bundle directory) without a restart or a lost request.

In one process (`ModelControl`):
- load: the bundle is loaded and warmed beside what serves, then swapped into the model table
  in one step of the event loop; a model of the same name (a replacement) keeps answering
  until then, and is retired after: it takes no new request, finishes those that picked it
  (`Model.users`), stops its batcher and is freed (its sessions, then the heap back to the
  system);
- unload: the model leaves the table (a request for it is a 404 naming what is served), then
  is retired the same way.

Across the workers of one port (`Board`): the worker that takes a management call makes the
change in itself first (a bundle that cannot load fails there, and nowhere else), then writes
the wanted set with a new generation to a file in a directory the supervisor made, and waits
until every serving worker reports that generation. Each worker watches the generation (shared
memory) and brings its table to the wanted set; a worker started later (a replacement, a
recycled worker's successor) loads the wanted set, not the start-up one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertserve.runtime.bundle import BUNDLE_FILE, BundleError, load_bundle_spec
from bertserve.runtime.engine import Engine
from bertserve.service.http.errors import (
    Conflict,
    DeadlineExceeded,
    LoadFailed,
    NotFound,
    NotReady,
)
from bertserve.service.models import (
    NAME,
    Model,
    bundle_version,
    defaults,
    floor_mb,
    load_model,
    load_models,
    model_info,
    repository,
)
from bertserve.service.process.memory import rss_mb
from bertserve.service.warmup import warm_up

if TYPE_CHECKING:
    from bertserve.service.state import ServiceState

log = logging.getLogger("bertserve.control")
WATCH_EVERY_S = 0.05  # how often a worker looks for a new wanted set
WANT, LOCK = "want.json", "lock"
# A model used this recently is not unloaded to make room for another (model_memory_mb): two
# requests' models alternating would otherwise load and unload at every request.
MIN_RESIDENCE_S = 10.0


@dataclass
class Status:
    """A model's state in one worker, as GET /models shows it."""

    state: str  # loading, ready, unloading, failed
    version: str = ""  # service.models.bundle_version
    reason: str | None = None  # why it failed, one line
    load_s: float | None = None  # its last load's time, warm-up included
    memory_mb: float | None = None  # what that load added to this worker's resident memory


def write(path: Path, data: dict[str, Any]) -> None:
    """`data` as JSON at `path`, whole or not at all (a reader never sees half a file)."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(data))
    temporary.replace(path)


def one_line(exc: Exception) -> str:
    """What a model's state says of a failure."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


@dataclass
class Board:
    """Where the workers of one port agree on the loaded set: `want.json` (name -> version, in
    load order, and its generation) and one report a worker (`report-<slot>.json`: the
    generation it has reached and its models' states) in `directory`, the generation in shared
    memory. Without a directory (one process, no supervisor) there is nobody to tell."""

    directory: str = ""
    slot: int = 0
    generation: Any = None  # multiprocessing Value: the newest wanted set's
    reached: Any = None  # multiprocessing Array: the generation each slot has reached
    serving: Callable[[int], bool] = lambda slot: False  # is that slot a ready, counted worker

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with open(os.path.join(self.directory, LOCK), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def wanted(self) -> tuple[int, dict[str, str]] | None:
        """The wanted set and its generation; None before the first management call."""
        if not self.directory:
            return None
        try:
            data = json.loads(Path(self.directory, WANT).read_text())
        except FileNotFoundError:
            return None
        return int(data["generation"]), dict(data["models"])

    def publish(self, name: str, version: str | None, table: dict[str, str]) -> int:
        """One change onto the wanted set (`name` at `version`; None: unloaded), read and
        written under the lock, so changes made at once in two workers both stand; before the
        first change the set is `table` (this worker's: the start-up set). Its generation."""
        if not self.directory:
            return 0
        with self.locked():
            current = self.wanted()
            generation, models = current if current else (0, dict(table))
            if version is None:
                models.pop(name, None)
            else:
                models[name] = version
            write(Path(self.directory, WANT), {"generation": generation + 1, "models": models})
            self.generation.value = generation + 1
        return generation + 1

    def report(self, generation: int, statuses: dict[str, Status]) -> None:
        if not self.directory:
            return
        data = {"generation": generation, "models": {n: asdict(s) for n, s in statuses.items()}}
        write(Path(self.directory, f"report-{self.slot}.json"), data)
        self.reached[self.slot] = generation

    def behind(self, generation: int) -> list[int]:
        """The serving workers (but this one) that have not reached `generation`."""
        if not self.directory:
            return []
        return [
            slot
            for slot in range(len(self.reached))
            if slot != self.slot and self.serving(slot) and self.reached[slot] < generation
        ]

    def reports(self) -> dict[int, dict[str, Any]]:
        """Every serving worker's report (this one's too), by slot."""
        out = {}
        for slot in range(len(self.reached) if self.directory else 0):
            if slot == self.slot or self.serving(slot):
                with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                    text = Path(self.directory, f"report-{slot}.json").read_text()
                    out[slot] = json.loads(text)
        return out


@dataclass
class ModelControl:
    """One worker's side of model management (see the module's docstring)."""

    state: ServiceState
    board: Board = field(default_factory=Board)
    statuses: dict[str, Status] = field(default_factory=dict)
    reached: int = 0  # the wanted set's generation this worker's table matches
    changed: list[Callable[[], None]] = field(default_factory=list)  # run after each change
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _demanded: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _watching: asyncio.Task[None] | None = None

    # --- start-up -------------------------------------------------------------------------------

    def load_start(self) -> dict[str, Model]:
        """The models to serve from the start: where a management call made a wanted set (this
        worker started after it), that set, each bundle loaded on its own (one that fails, or
        whose version is no longer the others', is reported, not fatal: the others serve);
        else the settings' set (service.models.load_models; a bad bundle stops the start)."""
        state, settings = self.state, self.state.settings
        wanted = self.board.wanted()
        if wanted is None:
            return load_models(
                settings,
                state.metrics,
                state.activity,
                state.engine_address,
                settings.start_models(),
            )
        self.reached, versions = wanted
        models: dict[str, Model] = {}
        for name, version in versions.items():
            try:
                model = load_model(
                    settings,
                    state.metrics,
                    settings.bundles / name,
                    state.activity,
                    state.engine_address,
                )
            except Exception as exc:
                reason = one_line(exc)
                self.statuses[name] = Status("failed", version, reason)
                log.error("loading %s at start failed: %s", name, reason)
                continue
            models[name] = model
            if model.version != version:
                self.statuses[name] = Status(
                    "ready",
                    model.version,
                    f"version {model.version[:12]} from disk, not the {version[:12]} the other "
                    "workers serve: the bundle changed since; load it again",
                )
        return models

    def started(self) -> None:
        """The start-up set is loaded: record it."""
        for model in self.state.models.values():
            self.statuses.setdefault(model.name, Status("ready", model.version))
            self.state.metrics.model_loaded.labels(model.name).set(1)
            self.state.metrics.model_memory.labels(model.name).set(model.memory_mb * 2**20)

    def warmed(self) -> None:
        """The start-up set is warm: report it, and follow the wanted set from now on (a change
        while the warm-up walks the table would pull models from under it). Static control
        never changes the set: nothing to watch."""
        if self.board.directory and self.state.settings.model_control == "explicit":
            self.board.report(self.reached, self.statuses)
            self._watching = asyncio.create_task(self._watch(), name="model-control")

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watching

    # --- the management API ---------------------------------------------------------------------

    def directory_of(self, name: str) -> Path:
        """The repository's bundle `name`, or a 404 that lists what the repository holds."""
        settings = self.state.settings
        if settings.model_control != "explicit":
            raise Conflict(
                "model control is static: the models are the bundles loaded at start; start "
                "with BERTSERVE_MODEL_CONTROL=explicit to load and unload them while serving"
            )
        if not self.state.warmed:
            raise NotReady("the service is starting: models are not loaded and warm yet")
        directory = settings.bundles / name
        if not NAME.fullmatch(name) or not (directory / BUNDLE_FILE).is_file():
            held = sorted(repository(settings.bundles))
            raise NotFound(
                f"no bundle {name!r} in the repository {settings.bundles}; it holds {held}"
            )
        return directory

    async def load(self, name: str) -> dict[str, Any]:
        """POST /models/{name}/load: load it, or replace it with the repository's version, in
        this worker, then in every other; its state once every worker has it."""
        directory = self.directory_of(name)
        async with self._lock:
            await self._follow()  # first what the others changed (never publish a stale set)
            loaded = self.state.models.get(name)
            if loaded is None or loaded.version != bundle_version(directory):
                await self._load_here(name, directory)
            else:  # unchanged: what it says is its state (a failed replacement's reason goes)
                status = self.statuses.get(name)
                self.statuses[name] = dataclasses.replace(
                    status or Status("ready", loaded.version), state="ready", reason=None
                )
            generation = await self._publish(name, self.state.models[name].version)
        return await self._agreed(name, generation)

    async def unload(self, name: str) -> dict[str, Any]:
        """POST /models/{name}/unload."""
        self.directory_of(name)
        async with self._lock:
            await self._follow()
            if name not in self.state.models:
                failed = self.statuses.pop(name, None)  # a failed load's state is cleared
                if failed is None:
                    raise NotFound(
                        f"model {name!r} is not loaded; loaded: {sorted(self.state.models)}"
                    )
            else:
                await self._unload_here(name)
            generation = await self._publish(name, None)
        return await self._agreed(name, generation)

    async def on_demand(self, name: str) -> None:
        """A request named `name`, a repository model that is not loaded, and a memory budget
        is set: load it (one load in this worker for every request that waits for it) and
        unload the least recently used models until the loaded ones fit the budget. The request
        waits within request_timeout_s; past it a 503 asks to retry."""
        loading = self._demanded.get(name)
        if loading is None:
            loading = asyncio.create_task(self._load_within_budget(name), name=f"demand-{name}")
            self._demanded[name] = loading
            loading.add_done_callback(lambda _: self._demanded.pop(name, None))
        timeout = self.state.settings.request_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(loading), timeout)
        except TimeoutError:
            raise NotReady(
                f"model {name!r} is loading on demand; retry shortly", retry_after_s=2
            ) from None

    async def _load_within_budget(self, name: str) -> None:
        if name not in self.state.models:
            await self.load(name)
        budget = self.state.settings.model_memory_mb
        models = self.state.models
        while sum(m.memory_mb for m in models.values()) > budget:
            now = time.monotonic()
            idle = [
                m
                for m in models.values()
                if m.name != name
                and m.name not in self._demanded
                and not m.users
                and now - m.used > MIN_RESIDENCE_S
            ]
            if not idle:  # all in use, or just used: over the budget until one is idle
                log.warning(
                    "model_memory_mb %g exceeded: every other loaded model is in use", budget
                )
                break
            coldest = min(idle, key=lambda m: m.used)
            log.info(
                "unloading %s, the least recently used, to keep within model_memory_mb %g",
                coldest.name,
                budget,
            )
            with contextlib.suppress(NotFound):  # unloaded meanwhile
                await self.unload(coldest.name)

    async def _publish(self, name: str, version: str | None) -> int:
        """The change (`name` now at `version`; None: unloaded) onto the wanted set, then
        whatever another worker published meanwhile (between this worker's follow and its
        change) followed here: this worker's table is the new set when it reports it."""
        generation = self.board.publish(
            name, version, {n: m.version for n, m in self.state.models.items()}
        )
        if generation == self.reached + 1:  # nothing else since: the set is this table
            self.reached = generation
            self.board.report(self.reached, self.statuses)
        else:
            await self._follow()
        return generation

    async def _agreed(self, name: str, generation: int) -> dict[str, Any]:
        """Wait until every serving worker has reached `generation`; the model's state, or the
        reason another worker could not follow."""
        deadline = time.monotonic() + self.state.settings.model_load_timeout_s
        while behind := self.board.behind(generation):
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"workers {behind} have not finished loading the change to {name!r} in "
                    f"{self.state.settings.model_load_timeout_s:g} s; it goes on (GET /models)"
                )
            await asyncio.sleep(WATCH_EVERY_S)
        mine = self.statuses.get(name)
        failed = [
            f"worker {slot}: {report['models'][name]['reason']}"
            for slot, report in self.board.reports().items()
            if slot != self.board.slot
            and report["models"].get(name, {}).get("reason")
            and (mine is None or report["models"][name]["version"] != mine.version)
        ]
        if failed:  # this worker has it; another could not follow (its memory, its disk)
            error = LoadFailed(f"model {name!r} failed to load in " + "; ".join(failed))
            error.status = 500
            raise error
        return self.describe(name)

    def describe(self, name: str) -> dict[str, Any]:
        status = self.statuses.get(name)
        workers = max(1, len(self.board.reports()))
        if status is None:
            return {"name": name, "state": "unloaded", "workers": workers}
        return {"name": name, **asdict(status), "workers": workers}

    # --- one worker -----------------------------------------------------------------------------

    async def _load_here(self, name: str, directory: Path, version: str | None = None) -> None:
        state, settings, metrics = self.state, self.state.settings, self.state.metrics
        old = state.models.get(name)
        self.statuses[name] = Status("loading", version or "")
        started, before = time.monotonic(), rss_mb()
        model: Model | None = None
        try:
            spec_name = (await asyncio.to_thread(load_bundle_spec, directory)).name
            if spec_name != name:
                raise BundleError(
                    f"{directory / BUNDLE_FILE} names its bundle {spec_name!r}: a repository "
                    "directory is named as its bundle"
                )
            model = await asyncio.to_thread(
                load_model, settings, metrics, directory, state.activity, state.engine_address
            )
            if version is not None and model.version != version:
                raise BundleError(
                    f"{directory} changed on disk while the workers loaded it (version "
                    f"{model.version[:12]} here, {version[:12]} in another worker); load it again"
                )
            model.batcher.start()
            if settings.warmup:
                await asyncio.to_thread(warm_up, [model], settings)
            if isinstance(model.engine, Engine):
                model.engine.warmed()
        except Exception as exc:  # a bad bundle, a warm-up that raised: the old one serves on
            if model is not None:
                await model.batcher.stop()
            reason = one_line(exc)
            self.statuses[name] = (
                Status("ready", old.version, f"replacement failed: {reason}")
                if old is not None
                else Status("failed", version or "", reason)
            )
            metrics.model_events.labels(name, "failed").inc()
            log.error("loading %s failed: %s", name, reason)
            raise LoadFailed(f"model {name!r} could not be loaded: {reason}") from exc
        seconds, added = time.monotonic() - started, max(0.0, rss_mb() - before)
        model.memory_mb = floor_mb(directory, model.spec, added)
        model.used = time.monotonic()
        state.models[name] = model  # a replacement keeps its predecessor's place
        self._changed()
        self.statuses[name] = Status("ready", model.version, None, round(seconds, 3), round(added))
        metrics.model_loaded.labels(name).set(1)
        metrics.model_memory.labels(name).set(model.memory_mb * 2**20)
        metrics.model_load_seconds.labels(name).observe(seconds)
        metrics.model_events.labels(name, "replaced" if old else "loaded").inc()
        log.info(
            "%s %s (version %s) in %.2f s, +%.0f MB",
            "replaced" if old else "loaded",
            name,
            model.version[:12],
            seconds,
            added,
        )
        if old is not None:
            await self._retire(old)

    async def _unload_here(self, name: str) -> None:
        model = self.state.models.pop(name)
        info = model_info(self.state.metrics, model.spec, model.engine.provider)
        self.statuses[name] = Status("unloading", model.version)
        self._changed()
        before = rss_mb()
        await self._retire(model)
        del model
        freed = before - rss_mb()
        self.statuses.pop(name, None)
        metrics = self.state.metrics
        metrics.model_loaded.labels(name).set(0)
        metrics.model_memory.labels(name).set(0)
        info.set(0)
        metrics.model_events.labels(name, "unloaded").inc()
        log.info("unloaded %s, -%.0f MB", name, freed)

    async def _retire(self, model: Model) -> None:
        """Once the requests that picked `model` are answered: stop it and free its memory."""
        deadline = time.monotonic() + self.state.settings.request_timeout_s + 5
        while model.users and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await model.batcher.stop()
        model.engine = model.batcher = None  # type: ignore[assignment]
        # What start-up loaded was frozen out of the collector's sight (service.state): let it
        # see the retired model's cycles once, then freeze what stays.
        gc.unfreeze()
        await asyncio.to_thread(gc.collect)
        gc.freeze()
        await asyncio.to_thread(self.state.trimmer.trim)

    def _changed(self) -> None:
        self.state.defaults = defaults(self.state.models)
        for hook in self.changed:
            hook()

    # --- following the other workers ------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            if self.board.generation.value > self.reached and not self._lock.locked():
                try:
                    async with self._lock:
                        await self._follow()
                except Exception:  # a failed load is reported; the watch goes on
                    log.exception("following the wanted model set failed")

    async def _follow(self) -> None:
        """Bring this worker's table to the newest wanted set (under the lock)."""
        wanted = self.board.wanted()
        if wanted is None or wanted[0] <= self.reached:
            return
        generation, models = wanted
        for name in [n for n in self.state.models if n not in models]:
            await self._unload_here(name)
        for name in [
            n for n, s in self.statuses.items() if n not in models and s.state == "failed"
        ]:
            del self.statuses[name]
        for name, version in models.items():
            loaded = self.state.models.get(name)
            if loaded is None or loaded.version != version:
                with contextlib.suppress(LoadFailed):
                    await self._load_here(name, self.state.settings.bundles / name, version)
            elif (status := self.statuses.get(name)) is not None and status.reason:
                self.statuses[name] = dataclasses.replace(status, state="ready", reason=None)
        self.reached = generation
        self.board.report(generation, self.statuses)
