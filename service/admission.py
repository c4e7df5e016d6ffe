"""Admission: whether a request is answered at once (503 draining or past a cap, 429 when every
model for its task is full) before its body is read. One decision a request
(ServiceState.admit), made by one entrance: the HTTP protocol (service.http.protocol), where it
reads the request's headers, or for a request pipelined behind another, when its turn comes. The app
runs only what was admitted; served by any other ASGI server, it admits everything."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bertserve.runtime.tasks import TASKS, Task
from bertserve.service.http.auth import PUBLIC_PATHS
from bertserve.service.http.errors import NotReady, Overloaded, RequestError, Unavailable
from bertserve.service.models import Model
from bertserve.service.settings import Settings
from bertserve.service.tenants import Held

if TYPE_CHECKING:
    from bertserve.service.state import ServiceState

CLOSE = {"Connection": "close"}  # a refusal that also ends the connection


class Admission:
    """The refusals that depend only on the settings, built once, and the decision."""

    def __init__(self, settings: Settings) -> None:
        self.settings = limits = settings
        self._draining = Unavailable("the service is shutting down; retry", CLOSE, retry_after_s=1)
        self.crowded = NotReady(
            f"{limits.max_in_flight} requests in flight (the limit); retry shortly",
            retry_after_s=1,
        )
        self._receiving = NotReady(
            f"{limits.max_receiving} requests are sending their bodies (the limit); retry shortly",
            retry_after_s=1,
        )
        self._connections = Unavailable(
            f"this process has {limits.max_connections} connections open (the limit); "
            "retry shortly",
            CLOSE,
            retry_after_s=1,
        )
        self._overloaded: dict[str, Overloaded] = {}  # by reason: a few fixed texts a model
        self._tenants: dict[tuple[str, str], RequestError] = {}  # by (tenant, cap)

    def refusal(
        self,
        state: ServiceState,
        method: str,
        path: str,
        connections: int = 0,
        size: int = -1,
        held: Held | None = None,
    ) -> RequestError | None:
        """Why this request is answered at once, before its body is parsed (None: it is admitted).
        Made once a request, by the HTTP protocol (service.http.protocol). The probes and
        /metrics always pass; the API key is checked after this, so an overloaded or draining
        service refuses unauthenticated requests the same way. `held`: its tenant's places,
        where several tenants share the process: past its share of a cap it is refused as at
        the cap, whatever the others hold (service.tenants)."""
        if path in PUBLIC_PATHS:
            return None
        if state.draining:  # the client should go elsewhere: this connection ends with it
            return self._draining
        if connections > self.settings.max_connections:
            return self._connections
        running = state.in_flight - state.queued >= self.settings.max_in_flight
        over = held is not None and held.running >= held.running_cap
        if (running or over) and not (
            self.may_queue(method, path, size)
            and state.queue_room(state.body_size(size), held)
            and bulk_room(state.models, routed(path, self.settings))
        ):
            return self.crowded if running or held is None else self.tenant_refusal(held, "running")
        if state.receiving >= self.settings.max_receiving:
            return self._receiving
        if held is not None and held.receiving >= held.receiving_cap:
            return self.tenant_refusal(held, "receiving")
        task = routed(path, self.settings)
        busy = (
            saturated(state.models, task.capability)
            if task is not None and method == "POST"
            else None
        )
        if busy is None:
            return None
        if busy not in self._overloaded:
            self._overloaded[busy] = Overloaded(busy, retry_after_s=1)
        return self._overloaded[busy]

    def tenant_refusal(self, held: Held, cap: str) -> RequestError:
        """A tenant past its share of max_in_flight (`running`) or max_receiving: a fixed text
        a tenant and cap, built once."""
        key = (held.tenant.name, cap)
        if key not in self._tenants:
            if cap == "running":
                what = f"{held.running_cap} requests in flight (its share of max_in_flight)"
            else:
                what = (
                    f"{held.receiving_cap} requests sending their bodies (its share of "
                    "max_receiving)"
                )
            self._tenants[key] = NotReady(
                f"tenant {held.tenant.name} has {what}; retry shortly", retry_after_s=1
            )
        return self._tenants[key]

    def may_queue(self, method: str, path: str, size: int) -> bool:
        """Whether a request may wait past the in-flight cap, if it is a client batch
        (service.state.Slot): a task's, whose body declares at least `queue_min_body_bytes`.
        A request of one short text is refused at the headers, where a flood of them costs
        least: read and parsed first, a 5x flood of single sentences was answered at 101 a
        second with 10.6% of its answers after 1 s, and 777 a second, none after 1 s, once
        refused here (make reliability, the same hour)."""
        return (
            size >= self.settings.queue_min_body_bytes
            and method == "POST"
            and routed(path, self.settings) is not None
        )


ROOT = "/"  # TEI's and Hugging Face InferenceClient's base URL: the root task's endpoint


def routed(path: str, settings: Settings) -> Task | None:
    """The task a path serves: its own, or for POST / the root task (`root_task`)."""
    task = TASKS.get(path)
    return TASKS[settings.root_task] if task is None and path == ROOT else task


def root_task(data: Any, settings: Settings) -> Task:
    """The task of a POST / body: /similarity for TEI's similarity inputs, else the root task."""
    inputs = data.get("inputs") if isinstance(data, dict) else None
    if isinstance(inputs, dict) and "source_sentence" in inputs:
        return TASKS["/similarity"]
    return TASKS[settings.root_task]


def bulk_room(models: dict[str, Model], task: Task | None) -> bool:
    """Some model serving `task` has room in its bulk lane (a client batch's rows would be
    queued, not refused): only then may a request wait past the in-flight cap."""
    if task is None:
        return False
    return any(
        m.batcher.refusal(2, bulk=True) is None
        for m in models.values()
        if task.capability in m.spec.tasks
    )


def saturated(models: dict[str, Model], task: str) -> str | None:
    """Why a request for `task` would be refused for load, when every model serving it has
    a full queue: checked before the body is read, so a 429 costs next to nothing."""
    serving = [m for m in models.values() if task in m.spec.tasks]
    reasons = []
    for model in serving:
        reason = model.batcher.refusal()
        if reason is None:
            return None
        reasons.append(reason)
    if not reasons:
        return None
    return f"every model for {task} is full ({'; '.join(reasons)}); retry shortly"
