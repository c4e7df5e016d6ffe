"""text-embeddings-inference's gRPC services (tei.v1: Info, Embed, Predict, Rerank, Tokenize),
each call answered as its JSON route answers the same request (the route named beside each
method), by the same `handle`, so numbers, limits and messages are the JSON routes'.

What the protocol leaves to the server, and bertserve's answer:
- the model: each route's default, or the bundle named in the call's `model` metadata (as
  `?model=` on HTTP);
- `truncate: false` is proto3's unset: the service's own default (BERTSERVE_AUTO_TRUNCATE), as
  a JSON body without `truncate`; `true` cuts;
- a stream's messages are requests of their own, admitted one by one and run concurrently (at
  most `max_client_batch` of one stream at once, so they batch together), answered in order;
  they are one client's batch, so they wait in the bulk lane as a client batch's rows do;
- `Metadata`: characters, tokens, the time queued and in the model, the total; the tokenising
  time is not measured apart and reads 0;
- PredictPair: the classifiers here read one text; a pair is a rerank model's (Rerank).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import orjson

from bertserve.runtime.tasks import TASKS
from bertserve.service.grpc import tei_pb2 as pb
from bertserve.service.grpc import tei_pb2_grpc as pb_grpc
from bertserve.service.grpc.calls import STREAMED, Refused, abort, admitted_call, urgency
from bertserve.service.handler import handle
from bertserve.service.http import routes
from bertserve.service.oip import VERSION
from bertserve.service.state import ServiceState

SERVICES = ("tei.v1.Info", "tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank", "tei.v1.Tokenize")
DIRECTION = {pb.TRUNCATION_DIRECTION_RIGHT: "Right", pb.TRUNCATION_DIRECTION_LEFT: "Left"}
MODEL_TYPE = {
    "embed": pb.MODEL_TYPE_EMBEDDING,
    "classify": pb.MODEL_TYPE_CLASSIFIER,
    "rerank": pb.MODEL_TYPE_RERANKER,
}


def model_of(context: grpc.aio.ServicerContext) -> str | None:
    """The bundle a call names in its `model` metadata (None: the route's default)."""
    for key, value in context.invocation_metadata() or ():
        if key == "model" and isinstance(value, str):
            return value
    return None


def truncating(flag: bool) -> bool | None:
    return True if flag else None


def metadata(stats: dict[str, Any], chars: int, started: float) -> Any:
    return pb.Metadata(
        compute_chars=chars,
        compute_tokens=int(stats.get("tokens", 0)),
        total_time_ns=int((time.monotonic() - started) * 1e9),
        tokenization_time_ns=int(stats.get("tokenize_ms", 0.0) * 1e6),
        queue_time_ns=int(stats.get("queue_ms", 0.0) * 1e6),
        inference_time_ns=int(stats.get("inference_ms", 0.0) * 1e6),
    )


class Base:
    def __init__(self, state: ServiceState) -> None:
        self.state = state

    async def run(
        self, context: Any, route: str, body: dict[str, Any], size: int, chars: int
    ) -> tuple[Any, Any]:
        """The JSON route's answer to `body` (decoded) and the call's Metadata."""
        started, stats = time.monotonic(), dict[str, Any]()
        batch = STREAMED.get()  # a stream's message: one row of the client's batch
        async with admitted_call(self.state, context, route, size, batch, stats) as slot:
            answer = await handle(
                self.state,
                TASKS[route],
                body,
                model_of(context),
                stats,
                slot=slot,
                batch=batch,
                urgency=urgency(context),
            )
        return orjson.loads(answer), metadata(stats, chars, started)

    async def stream(
        self,
        requests: AsyncIterator[Any],
        context: Any,
        one: Callable[[Any, Any], Awaitable[Any]],
    ) -> AsyncIterator[Any]:
        """A bidirectional stream: each message answered by `one`, concurrently (up to
        max_client_batch at once), the answers in the messages' order."""
        room = asyncio.Semaphore(self.state.settings.max_client_batch)
        pending: asyncio.Queue[asyncio.Future[Any] | None] = asyncio.Queue()

        async def answer(request: Any) -> Any:
            STREAMED.set(True)  # in this task's own context
            try:
                return await one(request, context)
            finally:
                room.release()

        async def feed() -> None:
            async for request in requests:
                await room.acquire()
                await pending.put(asyncio.ensure_future(answer(request)))
            await pending.put(None)

        feeder = asyncio.ensure_future(feed())
        try:
            while (item := await pending.get()) is not None:
                try:
                    reply = await item
                except Refused as refused:  # ended here, in the handler's own task
                    await abort(context, self.state, refused.error)
                else:
                    yield reply
            await feeder
        finally:
            feeder.cancel()
            while not pending.empty():
                left = pending.get_nowait()
                if left is not None:
                    left.cancel()


class Info(Base, pb_grpc.InfoServicer):
    async def Info(self, request: Any, context: Any) -> Any:
        state, settings = self.state, self.state.settings
        named = model_of(context)
        model = state.models.get(named) if named else None
        if model is None:
            model = next(
                (state.defaults[t] for t in ("embed", "classify", "rerank") if t in state.defaults),
                next(iter(state.models.values()), None),
            )
        if model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no model is loaded yet")
            raise AssertionError("abort raises")
        spec = model.spec
        kind = next((t for t in spec.tasks if t in MODEL_TYPE), "embed")
        return pb.InfoResponse(
            version=VERSION,
            model_id=spec.name,
            model_sha=model.version,
            model_dtype=spec.precision,
            model_type=MODEL_TYPE[kind],
            max_concurrent_requests=settings.max_in_flight,
            max_input_length=spec.max_seq_len,
            max_batch_tokens=settings.max_batch_tokens or 0,
            max_batch_requests=settings.max_batch_rows,
            max_client_batch_size=settings.max_client_batch,
            tokenization_workers=1,
        )


class Embed(Base, pb_grpc.EmbedServicer):
    async def Embed(self, request: Any, context: Any) -> Any:  # /embed
        body: dict[str, Any] = {
            "inputs": request.inputs,
            "truncate": truncating(request.truncate),
            "normalize": request.normalize,
            "truncation_direction": DIRECTION.get(request.truncation_direction, "Right"),
        }
        if request.HasField("prompt_name"):
            body["prompt_name"] = request.prompt_name
        answer, meta = await self.run(
            context, "/embed", body, request.ByteSize(), len(request.inputs)
        )
        return pb.EmbedResponse(embeddings=answer[0], metadata=meta)

    async def EmbedStream(self, requests: Any, context: Any) -> Any:
        async for reply in self.stream(requests, context, self.Embed):
            yield reply

    async def EmbedSparse(self, request: Any, context: Any) -> Any:  # /embed_sparse
        body = self._body(request)
        answer, meta = await self.run(
            context, "/embed_sparse", body, request.ByteSize(), len(request.inputs)
        )
        values = [pb.SparseValue(index=v["index"], value=v["value"]) for v in answer[0]]
        return pb.EmbedSparseResponse(sparse_embeddings=values, metadata=meta)

    async def EmbedSparseStream(self, requests: Any, context: Any) -> Any:
        async for reply in self.stream(requests, context, self.EmbedSparse):
            yield reply

    async def EmbedAll(self, request: Any, context: Any) -> Any:  # /embed_all
        body = self._body(request)
        answer, meta = await self.run(
            context, "/embed_all", body, request.ByteSize(), len(request.inputs)
        )
        tokens = [pb.TokenEmbedding(embeddings=t) for t in answer[0]]
        return pb.EmbedAllResponse(token_embeddings=tokens, metadata=meta)

    async def EmbedAllStream(self, requests: Any, context: Any) -> Any:
        async for reply in self.stream(requests, context, self.EmbedAll):
            yield reply

    @staticmethod
    def _body(request: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "inputs": request.inputs,
            "truncate": truncating(request.truncate),
            "truncation_direction": DIRECTION.get(request.truncation_direction, "Right"),
        }
        if request.HasField("prompt_name"):
            body["prompt_name"] = request.prompt_name
        return body


class Predict(Base, pb_grpc.PredictServicer):
    async def Predict(self, request: Any, context: Any) -> Any:  # /classify
        parameters: dict[str, Any] = {"top_k": None, "truncation": request.truncate}
        if request.raw_scores:
            parameters["function_to_apply"] = "none"
        body = {"inputs": [request.inputs], "parameters": parameters}
        answer, meta = await self.run(
            context, "/classify", body, request.ByteSize(), len(request.inputs)
        )
        predictions = [pb.Prediction(score=p["score"], label=p["label"]) for p in answer[0]]
        return pb.PredictResponse(predictions=predictions, metadata=meta)

    async def PredictStream(self, requests: Any, context: Any) -> Any:
        async for reply in self.stream(requests, context, self.Predict):
            yield reply

    async def PredictPair(self, request: Any, context: Any) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "the classifiers served here read one text; a pair is scored by a rerank model: "
            "call tei.v1.Rerank/Rerank",
        )

    async def PredictPairStream(self, requests: Any, context: Any) -> Any:
        await self.PredictPair(None, context)
        yield pb.PredictResponse()  # never reached: the call is aborted


class Rerank(Base, pb_grpc.RerankServicer):
    async def Rerank(self, request: Any, context: Any) -> Any:  # /rerank
        body = {
            "query": request.query,
            "texts": list(request.texts),
            "truncate": truncating(request.truncate),
            "raw_scores": request.raw_scores,
            "return_text": request.return_text,
            "truncation_direction": DIRECTION.get(request.truncation_direction, "Right"),
        }
        chars = len(request.query) + sum(len(t) for t in request.texts)
        answer, meta = await self.run(context, "/rerank", body, request.ByteSize(), chars)
        return pb.RerankResponse(ranks=[self._rank(r) for r in answer], metadata=meta)

    async def RerankStream(self, requests: Any, context: Any) -> Any:
        """The streamed (query, text) pairs ranked together: one /rerank a distinct query
        (its texts in the order sent), the ranks merged best first with their stream index."""
        pairs = [r async for r in requests]
        if not pairs:
            return pb.RerankResponse()
        first = pairs[0]
        by_query: dict[str, list[int]] = {}
        for i, pair in enumerate(pairs):
            by_query.setdefault(pair.query, []).append(i)
        ranks, metas = [], []
        for query, indices in by_query.items():
            request = pb.RerankRequest(
                query=query,
                texts=[pairs[i].text for i in indices],
                truncate=first.truncate,
                raw_scores=first.raw_scores,
                return_text=first.return_text,
                truncation_direction=first.truncation_direction,
            )
            answer = await self.Rerank(request, context)
            metas.append(answer.metadata)
            for rank in answer.ranks:
                rank.index = indices[rank.index]
                ranks.append(rank)
        ranks.sort(key=lambda r: -r.score)
        meta = pb.Metadata(
            compute_chars=sum(m.compute_chars for m in metas),
            compute_tokens=sum(m.compute_tokens for m in metas),
            total_time_ns=sum(m.total_time_ns for m in metas),
            tokenization_time_ns=sum(m.tokenization_time_ns for m in metas),
            queue_time_ns=sum(m.queue_time_ns for m in metas),
            inference_time_ns=sum(m.inference_time_ns for m in metas),
        )
        return pb.RerankResponse(ranks=ranks, metadata=meta)

    @staticmethod
    def _rank(item: dict[str, Any]) -> Any:
        rank = pb.Rank(index=item["index"], score=item["score"])
        if item.get("text") is not None:
            rank.text = item["text"]
        return rank


class Tokenize(Base, pb_grpc.TokenizeServicer):
    async def Tokenize(self, request: Any, context: Any) -> Any:  # /tokenize
        async with admitted_call(self.state, context, "/tokenize", request.ByteSize()):
            body = routes.TokenizeRequest.model_validate(
                {
                    "inputs": request.inputs,
                    "add_special_tokens": request.add_special_tokens,
                    "prompt_name": request.prompt_name if request.HasField("prompt_name") else None,
                }
            )
            answer = orjson.loads(await routes.tokenize_answer(self.state, body, model_of(context)))
        return pb.EncodeResponse(tokens=[pb.SimpleToken(**t) for t in answer[0]])

    async def TokenizeStream(self, requests: Any, context: Any) -> Any:
        async for reply in self.stream(requests, context, self.Tokenize):
            yield reply

    async def Decode(self, request: Any, context: Any) -> Any:  # /decode
        async with admitted_call(self.state, context, "/decode", request.ByteSize()):
            body = routes.DecodeRequest.model_validate(
                {"ids": list(request.ids), "skip_special_tokens": request.skip_special_tokens}
            )
            answer = orjson.loads(await routes.decode_answer(self.state, body, model_of(context)))
        return pb.DecodeResponse(text=answer[0])

    async def DecodeStream(self, requests: Any, context: Any) -> Any:
        async for reply in self.stream(requests, context, self.Decode):
            yield reply


def add(server: grpc.aio.Server, state: ServiceState) -> list[str]:
    pb_grpc.add_InfoServicer_to_server(Info(state), server)
    pb_grpc.add_EmbedServicer_to_server(Embed(state), server)
    pb_grpc.add_PredictServicer_to_server(Predict(state), server)
    pb_grpc.add_RerankServicer_to_server(Rerank(state), server)
    pb_grpc.add_TokenizeServicer_to_server(Tokenize(state), server)
    return list(SERVICES)
