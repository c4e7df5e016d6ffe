"""`handle`: one request of one task, from its body to its answer, with no web framework.

validate -> pick the model -> prepare (tokenise, windows) -> bound the work -> submit to the
model's batcher -> finish (decode) -> respond, timing each stage. The FastAPI routes and the
fast path are thin adapters over it (service/http/routes.py, service/http/fastpath.py);
evaluation calls the same task code with its own backend (model/training/evaluate.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import orjson
from pydantic import BaseModel

from bertserve.runtime.batching import Row, RowResult, gather, lower_priority
from bertserve.runtime.tasks import Task
from bertserve.runtime.tasks.common import ROUTE, checkpoint, deadline_check, unwatch, watch
from bertserve.service.http.asgi import NO_URGENCY, Gone, Urgency
from bertserve.service.http.errors import (
    InvalidInput,
    NotFound,
    NotLoaded,
    Overloaded,
    RequestError,
    TooLarge,
)
from bertserve.service.state import Model, ServiceState, Slot
from bertserve.service.tenants import ANONYMOUS, Tenant
from bertserve.service.tracing import RowTrace, request_spans


async def handle(
    state: ServiceState,
    task: Task,
    body: BaseModel | Any,
    model_name: str | None,
    stats: dict[str, Any],
    disconnected: Gone | None = None,
    client: bytes = b"",
    slot: Slot | None = None,
    batch: bool = False,
    urgency: Urgency = NO_URGENCY,
) -> Any:
    """The answer to one request, as JSON bytes; raises a RequestError (or pydantic's
    ValidationError, for a body that is not a `task.request`) for anything else. `stats`
    receives what the access log reports: model, rows, tokens, queue_ms, inference_ms, and
    the tenant's name for a keyed request (service.tenants).

    A request's own work is bounded before it is done (`Task.check_cost`), and a large one
    prepares and decodes on a worker thread: the event loop, which answers every other client
    and the probes, never runs one request's tokenising or decoding for long. Its deadline
    (request_timeout_s) and its client's leaving stop it between stages and inside the tasks'
    long loops (`checkpoint`): 504 or 499, never a late 200. `client`: the User-Agent, for a
    task whose answer to one input some client reads differently (`Task.nests_single_for`).
    `slot`: its place (service.state.Slot): a client batch moves to a queued place; a request
    of one input admitted past the in-flight cap is refused. `batch`: served as a client batch
    whatever its inputs (a gRPC stream's messages, which are one client's batch). `urgency`: its
    priority (a body's own `priority` field wins) and its own timeout, capped by
    request_timeout_s: its rows are dropped, and it is answered 504, once that has passed."""
    settings = state.settings
    if "span" in stats:  # traced (service.tracing): where the body's reading ended
        stats["handler_at"] = time.perf_counter()
    gone = disconnected.done if isinstance(disconnected, asyncio.Future) else lambda: False
    timeout = settings.request_timeout_s
    own = urgency.timeout_s is not None and urgency.timeout_s < timeout
    if own:  # a timeout of its own, from when the app first saw the request
        timeout = urgency.timeout_s  # type: ignore[assignment]
    deadline = (urgency.since if own and urgency.since else time.monotonic()) + timeout
    token = watch(deadline_check(deadline, gone))
    route = ROUTE.set(task.path)  # a 413 for an over-long input speaks this route's syntax
    try:
        return await _handle(
            state,
            task,
            body,
            model_name,
            stats,
            disconnected,
            client,
            slot,
            batch,
            urgency.priority,
            deadline if own else None,
        )
    finally:
        ROUTE.reset(route)
        unwatch(token)


@dataclass(slots=True)
class Call:
    """One request on its way through the handler: what it asked, the model it runs on, and
    what it becomes (rows, the task's prepared state, the model's results)."""

    state: ServiceState
    task: Task
    model: Model
    request: Any
    items: list[Any]
    single: bool
    stats: dict[str, Any]  # what the access log reports
    disconnected: Gone | None
    bulk: bool  # a client batch: its rows wait in the bulk lane
    priority: int | None  # the batcher's (None: its default for the kind)
    deadline: float | None  # its own (time.monotonic), else None: request_timeout_s's
    tenant: Tenant  # whose (service.tenants): its share of the model's queue
    rows: list[Row] = field(default_factory=list)
    prepared: Any = None
    results: list[RowResult] = field(default_factory=list)


async def _handle(
    state: ServiceState,
    task: Task,
    body: BaseModel | Any,
    model_name: str | None,
    stats: dict[str, Any],
    disconnected: Gone | None,
    client: bytes,
    slot: Slot | None,
    batch: bool,
    priority: int | None,
    deadline: float | None,
) -> Any:
    request = body if isinstance(body, task.request) else task.request.model_validate(body)
    for attempt in range(3):  # with a memory budget, loaded on demand (service.control);
        try:  # another worker's eviction may take it away again before it is picked here
            model = pick_model(state, task, request, model_name)
            break
        except NotLoaded as missing:
            if not state.settings.model_memory_mb or attempt == 2:
                raise
            await state.control.on_demand(missing.name)
    if state.settings.model_memory_mb:  # what the budget's least-recently-used order reads
        model.used = time.monotonic()
    model.users += 1  # a model replaced or unloaded meanwhile is retired once this is answered
    try:
        return await _serve(
            state,
            task,
            request,
            model,
            stats,
            disconnected,
            client,
            slot,
            batch,
            priority,
            deadline,
        )
    finally:
        model.users -= 1


async def _serve(
    state: ServiceState,
    task: Task,
    request: Any,
    model: Model,
    stats: dict[str, Any],
    disconnected: Gone | None,
    client: bytes,
    slot: Slot | None,
    batch: bool,
    priority: int | None,
    deadline: float | None,  # time.monotonic
) -> Any:
    settings = state.settings
    items, single = task.inputs(request)
    if single and any(name in client for name in task.nests_single_for):
        single = False  # answered as a list of one input's answer
    if not items:
        raise InvalidInput("inputs is an empty list")
    most = settings.request_limits[task.batch_limit]
    if len(items) > most:
        raise TooLarge(
            f"{len(items)} {task.items_name} in one request; the limit is {most} "
            f"(BERTSERVE_{task.batch_limit.upper()})"
        )
    bulk = batch or len(items) > 1
    # Whose (service.tenants): its share of the model's queue, and its default priority.
    tenant = slot.tenant if slot is not None and slot.tenant is not None else ANONYMOUS
    if bulk:  # a client batch: refused before its tokenising if its lane (its share) is full
        full = model.batcher.refusal(len(items), True, tenant.name, tenant.weight)
        if full is not None:
            await refuse(state, slot, Overloaded(f"{full}; retry shortly", retry_after_s=1))
        if slot is not None:
            slot.batch()  # waits in the bulk lane; its in-flight slot goes to single requests
    elif slot is not None and slot.queued:  # past the in-flight cap only a client batch waits
        await refuse(state, slot, state.admission.crowded)
    own = getattr(request, "priority", None)  # Cohere's and vLLM's body field, where it has one
    priority = own if isinstance(own, int) else priority
    if priority is None:  # neither the body nor a header: its tenant's default, if it has one
        priority = tenant.priority
    call = Call(
        state,
        task,
        model,
        request,
        items,
        single,
        stats,
        disconnected,
        bulk,
        priority,
        deadline,
        tenant,
    )
    cost = task.check_cost(model.ctx, items, request, settings)
    if cost <= settings.inline_cost:
        return await _run(call, off_loop=False)
    try:
        return await _run(call, off_loop=True)
    finally:  # what its tokenising and decoding freed goes back to the system
        # (service.process.memory)
        if state.trimmer.due():
            await asyncio.to_thread(state.trimmer.trim)


async def refuse(state: ServiceState, slot: Slot | None, error: RequestError) -> NoReturn:
    """Refuse for load as the protocol refuses at the gate: after refusal_delay_ms (a client
    that retries at once must not make refusals most of the work), its place given back first
    so that waiting out the delay holds none."""
    if slot is not None:
        slot.release()
    await asyncio.sleep(state.settings.refusal_delay_ms / 1000)
    raise error


async def _run(call: Call, off_loop: bool) -> Any:
    settings, task, model = call.state.settings, call.task, call.model
    stage = call.state.metrics.stages(task.path)
    t0 = time.perf_counter()
    bulk = call.bulk
    nice = settings.bulk_nice if bulk else None
    if off_loop:
        call.rows, call.prepared = await off_the_loop(
            nice, task.plan, model.ctx, call.items, call.request
        )
    else:
        call.rows, call.prepared = task.plan(model.ctx, call.items, call.request)
    t1 = time.perf_counter()
    call.stats["tokenize_ms"] = 1000 * (t1 - t0)  # TEI's tokenization_time_ns (service.grpc.tei)
    checkpoint()
    rows = call.rows
    # More could never be admitted: a client batch's rows queue in the bulk lane.
    queue = settings.max_bulk_queue_rows if bulk else settings.max_queue_rows
    # A row an input at least (2,048 texts are 2,048 rows), and a MaxSim rerank's query its
    # own; the windows of long texts, more.
    limit = min(max(settings.request_limits[task.rows_limit], len(call.items) + 1), queue)
    if len(rows) > limit:  # a 100,000-token text: refused before it is queued or computed
        raise TooLarge(
            f"the input needs {len(rows)} sequences of up to {model.ctx.max_len} tokens; one "
            f"request may use {limit}. Send a shorter text or fewer inputs"
        )
    work = model.batcher.work_s(rows)
    if work > 0.8 * settings.request_timeout_s:  # could not end by its deadline even alone:
        # refused before its model time is spent (a 2,048-passage /embed took 30 s, then 504)
        raise TooLarge(
            f"the input needs at least {work:.0f} s of model time at the rate this model serves "
            "tokens in batches; the deadline is "
            f"{settings.request_timeout_s:g} s (BERTSERVE_REQUEST_TIMEOUT_S). Send fewer or "
            "shorter inputs a request"
        )
    call.stats.update(model=model.name, rows=len(rows), tokens=sum(len(r) for r in rows))
    if call.tenant is not ANONYMOUS:  # whose, by name (service.tenants; never its key)
        call.stats["tenant"] = call.tenant.name
    traced = "span" in call.stats
    if traced:  # each row carries the request's trace to the batch span
        trace = RowTrace(call.stats["tracing"], call.stats["span"].get_span_context())
        for r in rows:
            r.trace = trace
    call.results = results = await submit(
        model, rows, call.disconnected, bulk, call.priority, call.deadline, call.tenant
    )
    t2 = time.perf_counter()
    if traced:
        call.stats["answered_at"] = t2
        request_spans(call.stats, t0, t1, results)
    checkpoint()
    body_out = await off_the_loop(nice, finish, call) if off_loop else finish(call)
    t3 = time.perf_counter()
    checkpoint()  # a client that left while its answer was made: logged 499, not 200
    # The request waited for its slowest row: that is its queue and inference time, in the
    # stage histograms and in the access log alike.
    queue_s = max((r.queue_s for r in results), default=0.0)
    inference_s = max((r.inference_s for r in results), default=0.0)
    call.stats.update(queue_ms=1000 * queue_s, inference_ms=1000 * inference_s)
    stage["tokenize"].observe(t1 - t0)
    stage["queue"].observe(queue_s)
    stage["inference"].observe(inference_s)
    stage["postprocess"].observe(t3 - t2)
    return body_out


T = TypeVar("T")
# Client batches tokenise and decode on threads of their own, at bulk_nice: 512 of them queued
# on asyncio's default pool (6 threads on 2 cores) would hold up a long /qa request of one
# input behind them.
_BULK_POOL: ThreadPoolExecutor | None = None


async def off_the_loop(nice: int | None, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a worker thread: a client batch's (`nice`: bulk_nice) on the bulk pool,
    any other (None) on asyncio's default one; the request's context (its deadline check)
    goes with it."""
    if nice is None:
        return await asyncio.to_thread(fn, *args)
    global _BULK_POOL
    if _BULK_POOL is None:
        _BULK_POOL = ThreadPoolExecutor(
            2, "bulk-prepare", initializer=lower_priority, initargs=(nice,)
        )
    context = contextvars.copy_context()
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_BULK_POOL, functools.partial(context.run, fn, *args))


def finish(call: Call) -> bytes:
    """Decode the model's results into the task's answers, and the answers into JSON."""
    task, model, request = call.task, call.model, call.request
    answers = task.finish(model.ctx, call.prepared, call.results, request)
    # numpy arrays (embeddings) are written as they are: float32 in its shortest exact form.
    answer = task.respond(answers, call.single, request, call.rows, model.name)
    body = orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY)
    limit = call.state.settings.max_response_bytes
    if len(body) > limit:  # a last guard: the cost check comes first
        raise TooLarge(
            f"the answer would be {len(body):,} bytes; the limit is {limit:,}. Ask for fewer "
            "inputs or a smaller top_k"
        )
    return body


def pick_model(state: ServiceState, task: Task, request: Any, query_name: str | None) -> Model:
    name = query_name or task.model_name(request)
    if name is not None and query_name is None and task.lenient_model_name:
        model = state.models.get(name)  # no per-request rebuild of the task -> models table
        name = name if model is not None and task.capability in model.spec.tasks else None
    needs = task.needs(request)
    if not needs:
        return state.model_for(task.capability, name)
    # A request for several heads of one bundle: a model with them all (the default of the
    # task's capability if it has them, else the first by name that does).
    model = state.model_for(task.capability, name)  # readiness, the name, the capability
    wanted = (task.capability, *needs)
    if set(wanted) <= set(model.spec.tasks):
        return model
    serving = sorted(m.name for m in state.models.values() if set(wanted) <= set(m.spec.tasks))
    if name is None and serving:
        return state.models[serving[0]]
    held = f"model {name!r} serves {', '.join(model.spec.tasks)}; " if name is not None else ""
    raise NotFound(
        f"{held}{' and '.join(wanted)} from one encoder: models for them: {serving} "
        f"(bertserve export --task {','.join(wanted)} makes one)"
    )


async def submit(
    model: Model,
    rows: list[Row],
    disconnected: Gone | None,
    bulk: bool = False,
    priority: int | None = None,
    deadline: float | None = None,
    tenant: Tenant = ANONYMOUS,
) -> list[RowResult]:
    """Queue the rows; if the client goes away first, cancel them (they cost no compute).
    `disconnected`: a future the server completes when the connection is lost (bertserve's
    protocol), or a coroutine function to watch for it (any other ASGI server). A request of
    no rows (an inference-free sparse query: runtime/tasks/sparse.py) needs no model call."""
    if not rows:
        return []
    futures = model.batcher.enqueue(rows, bulk, priority, deadline, tenant.name, tenant.weight)
    if disconnected is None or isinstance(disconnected, asyncio.Future):
        return await gather(futures, disconnected)
    watch = asyncio.ensure_future(disconnected())
    try:
        return await gather(futures, watch)
    finally:
        watch.cancel()
