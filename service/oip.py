"""The Open Inference Protocol v2 (KServe's and Triton's): every served model and task as an
inference model of named tensors, for the REST routes (service/http/oip.py) and the gRPC
service (service/grpc/oip.py) alike.

An OIP model is a bundle and one of its tasks: `NAME` is the bundle's first task, `NAME.TASK`
any of them (`pretrained.nsp`). Text goes in as BYTES tensors (UTF-8, shape [N] or [N, 1]); an
inference is the JSON route's request built from the tensors and answered by the same `handle`
(so the numbers, limits and errors are the JSON routes'), its answer then written as tensors:
the typed outputs each task has (`SIGNATURES`; docs/api.md's Open Inference Protocol section)
and `JSON`, each input's answer as the JSON route writes it. A request's `parameters` are the
route's own options (`top_k`, `normalize`, `truncate`, ...): for the tasks whose JSON body has
a `parameters` object they go there, else beside `inputs`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata as distribution
from typing import Any

import numpy as np
import orjson

from bertserve.runtime.tasks import TASKS, Task
from bertserve.service.handler import handle
from bertserve.service.http.asgi import NO_URGENCY, Urgency, parse_urgency
from bertserve.service.http.errors import InvalidInput, NotFound
from bertserve.service.models import Model
from bertserve.service.state import ServiceState

PLATFORM = "bertserve_onnxruntime"
try:  # the installed distribution's version (the server metadata of both protocols)
    VERSION = distribution.version("bertserve")
except distribution.PackageNotFoundError:  # run from a tree that is not installed
    VERSION = "0+unknown"
INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
# Request parameters that belong to the protocol (the binary data extension), not to a route.
# (`priority` and `timeout`, in microseconds, are Triton's request parameters: the queue's.)
PROTOCOL_PARAMETERS = frozenset(
    {"binary_data_output", "binary_data", "binary_data_size", "priority", "timeout"}
)
NUMPY = {
    "BOOL": np.bool_,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP32": np.float32,
    "FP64": np.float64,
}


@dataclass
class Tensor:
    """A named tensor. BYTES data is a numpy object array of `bytes`."""

    name: str
    datatype: str
    shape: list[int]
    data: np.ndarray


@dataclass(frozen=True)
class Signature:
    """One task as an OIP model: the JSON route it is, its input tensors (all BYTES, one text
    each per row; `per_request` ones hold one text for the request), its typed outputs
    (name, datatype, shape with -1 for the rows), how the tensors make the route's body and
    how its answer makes the outputs."""

    route: str
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]
    body: Callable[[dict[str, list[str]]], dict[str, Any]]
    tensors: Callable[[Any, int], dict[str, np.ndarray]]
    per_request: tuple[str, ...] = ()
    nested: bool = True  # the route's body has a `parameters` object (the pipelines' tasks)


def _first(answer: list[list[dict[str, Any]]], key: str) -> list[Any]:
    return [items[0][key] if items else None for items in answer]


def _classify(answer: Any, n: int) -> dict[str, np.ndarray]:
    return {
        "LABEL": _bytes([str(label) for label in _first(answer, "label")]),
        "SCORE": np.asarray(_first(answer, "score"), np.float32),
    }


def _embed(answer: Any, n: int) -> dict[str, np.ndarray]:
    return {"EMBEDDING": np.asarray(answer, np.float32).reshape(n, -1)}


def _rerank(answer: Any, n: int) -> dict[str, np.ndarray]:
    scores = np.zeros(n, np.float32)
    for item in answer:
        scores[item["index"]] = item["score"]
    return {"SCORE": scores}


def _qa(answer: Any, n: int) -> dict[str, np.ndarray]:
    answer = answer if isinstance(answer, list) else [answer]
    return {
        "ANSWER": _bytes([a["answer"] for a in answer]),
        "SCORE": np.asarray([a["score"] for a in answer], np.float32),
        "START": np.asarray([a["start"] for a in answer], np.int64),
        "END": np.asarray([a["end"] for a in answer], np.int64),
    }


def _nsp(answer: Any, n: int) -> dict[str, np.ndarray]:
    return {
        "IS_NEXT": np.asarray([a["is_next"] for a in answer], np.bool_),
        "SCORE": np.asarray([a["score"] for a in answer], np.float32),
    }


def _fill_mask(answer: Any, n: int) -> dict[str, np.ndarray]:
    # One [MASK] an input: its candidates, best first. With several masks an input the route
    # answers a list a mask; the first mask's candidates are given here (JSON has them all).
    firsts = [items[0] if items and isinstance(items[0], list) else items for items in answer]
    k = min(len(items) for items in firsts)
    return {
        "TOKEN_STR": _bytes([i["token_str"] for items in firsts for i in items[:k]]).reshape(n, k),
        "SCORE": np.asarray([[i["score"] for i in items[:k]] for items in firsts], np.float32),
    }


def _none(answer: Any, n: int) -> dict[str, np.ndarray]:
    return {}


def _texts(field: str = "TEXT") -> Callable[[dict[str, list[str]]], dict[str, Any]]:
    return lambda t: {"inputs": t[field]}


ROWS = -1
SIGNATURES: dict[str, Signature] = {
    "classify": Signature(
        "/classify",
        ("TEXT",),
        (("LABEL", "BYTES", (ROWS,)), ("SCORE", "FP32", (ROWS,))),
        _texts(),
        _classify,
    ),
    "ner": Signature("/ner", ("TEXT",), (), _texts(), _none),
    "qa": Signature(
        "/qa",
        ("QUESTION", "CONTEXT"),
        (
            ("ANSWER", "BYTES", (ROWS,)),
            ("SCORE", "FP32", (ROWS,)),
            ("START", "INT64", (ROWS,)),
            ("END", "INT64", (ROWS,)),
        ),
        lambda t: {
            "inputs": [
                {"question": q, "context": c}
                for q, c in zip(t["QUESTION"], t["CONTEXT"], strict=True)
            ]
        },
        _qa,
    ),
    "nsp": Signature(
        "/nsp",
        ("TEXT", "TEXT_PAIR"),
        (("IS_NEXT", "BOOL", (ROWS,)), ("SCORE", "FP32", (ROWS,))),
        lambda t: {
            "inputs": [
                {"text": a, "text_pair": b} for a, b in zip(t["TEXT"], t["TEXT_PAIR"], strict=True)
            ]
        },
        _nsp,
    ),
    "fill-mask": Signature(
        "/fill-mask",
        ("TEXT",),
        (("TOKEN_STR", "BYTES", (ROWS, ROWS)), ("SCORE", "FP32", (ROWS, ROWS))),
        _texts(),
        _fill_mask,
    ),
    "embed": Signature(
        "/embed", ("TEXT",), (("EMBEDDING", "FP32", (ROWS, ROWS)),), _texts(), _embed, nested=False
    ),
    "rerank": Signature(
        "/rerank",
        ("QUERY", "TEXT"),
        (("SCORE", "FP32", (ROWS,)),),
        lambda t: {"query": t["QUERY"][0], "texts": t["TEXT"]},
        _rerank,
        per_request=("QUERY",),
        nested=False,
    ),
    "sparse": Signature("/embed_sparse", ("TEXT",), (), _texts(), _none, nested=False),
    "multivector": Signature("/v1/multi-vector", ("TEXT",), (), _texts(), _none, nested=False),
}


@dataclass(frozen=True)
class Endpoint:
    """An OIP model: the name it is called by, the bundle and the task it runs."""

    name: str
    model: Model
    capability: str

    @property
    def signature(self) -> Signature:
        return SIGNATURES[self.capability]

    @property
    def task(self) -> Task:
        return TASKS[self.signature.route]

    def output_specs(self) -> list[tuple[str, str, list[int]]]:
        """Every output: the typed ones (an embedding's width filled in) and JSON."""
        width = self.model.spec.architecture.hidden_size
        specs = [
            (name, dtype, [width if name == "EMBEDDING" and i == 1 else d for i, d in enumerate(s)])
            for name, dtype, s in self.signature.outputs
        ]
        return [*specs, ("JSON", "BYTES", [ROWS])]


_CACHE: dict[int, tuple[tuple[Model, ...], dict[str, Endpoint]]] = {}


def endpoints(state: ServiceState) -> dict[str, Endpoint]:
    """Every OIP model this service serves now, by name: built again only when the loaded
    models change (each request asks)."""
    key = tuple(state.models.values())
    cached = _CACHE.get(id(state))
    if (
        cached is not None
        and len(cached[0]) == len(key)
        and all(a is b for a, b in zip(cached[0], key, strict=True))
    ):
        return cached[1]
    out: dict[str, Endpoint] = {}
    for name, model in state.models.items():
        served = [t for t in model.spec.tasks if t in SIGNATURES]
        for capability in served:
            out[f"{name}.{capability}"] = Endpoint(f"{name}.{capability}", model, capability)
        if served:
            out[name] = Endpoint(name, model, served[0])
    _CACHE[id(state)] = (key, out)
    return out


def endpoint(state: ServiceState, name: str, version: str | None = None) -> Endpoint:
    """The OIP model `name` (at `version`, if one is named), else a 404 that says what is."""
    found = endpoints(state).get(name)
    if found is None:
        known = ", ".join(sorted(endpoints(state))) or "none"
        raise NotFound(f"no model {name!r}; served: {known}")
    if version and version != found.model.version:
        raise NotFound(
            f"model {name!r} has no version {version!r}; it serves {found.model.version!r}"
        )
    return found


def metadata(found: Endpoint) -> dict[str, Any]:
    """The model metadata response (OIP's $metadata_model_response)."""
    sig = found.signature
    return {
        "name": found.name,
        "versions": [found.model.version],
        "platform": PLATFORM,
        "inputs": [
            {"name": n, "datatype": "BYTES", "shape": [1] if n in sig.per_request else [ROWS]}
            for n in sig.inputs
        ],
        "outputs": [{"name": n, "datatype": d, "shape": s} for n, d, s in found.output_specs()],
        "parameters": {"task": found.capability, "route": sig.route},
    }


def server_metadata(version: str) -> dict[str, Any]:
    return {"name": "bertserve", "version": version, "extensions": ["binary_tensor_data"]}


def texts_of(found: Endpoint, inputs: list[Tensor]) -> dict[str, list[str]]:
    """The request's text tensors by name, checked against the model's signature: each a BYTES
    tensor of shape [N] or [N, 1] (a per-request one [1]), all of the same N."""
    sig = found.signature
    by_name: dict[str, Tensor] = {}
    for tensor in inputs:
        if tensor.name not in sig.inputs:
            raise InvalidInput(
                f"model {found.name!r} has no input {tensor.name!r}; its inputs: "
                f"{', '.join(sig.inputs)}"
            )
        if tensor.name in by_name:
            raise InvalidInput(f"input {tensor.name!r} is given twice")
        by_name[tensor.name] = tensor
    missing = [n for n in sig.inputs if n not in by_name]
    if missing:
        raise InvalidInput(f"model {found.name!r} needs the inputs {', '.join(missing)}")
    out: dict[str, list[str]] = {}
    rows = None
    for name in sig.inputs:
        tensor = by_name[name]
        if tensor.datatype != "BYTES":
            raise InvalidInput(
                f"input {name!r} is {tensor.datatype}; it takes text: datatype BYTES"
            )
        shape = tensor.shape
        if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 1:
            raise InvalidInput(
                f"input {name!r} has shape {shape}; it takes [N] or [N, 1] texts (N >= 1)"
            )
        values = tensor.data.reshape(-1)
        if len(values) != shape[0]:
            raise InvalidInput(f"input {name!r} has shape {shape} but {len(values)} elements")
        if name in sig.per_request:
            if shape[0] != 1:
                raise InvalidInput(f"input {name!r} is one text a request: shape [1]")
        elif rows is None:
            rows = shape[0]
        elif shape[0] != rows:
            raise InvalidInput(
                f"inputs {', '.join(sig.inputs)} must have as many texts each; "
                f"{name!r} has {shape[0]}, not {rows}"
            )
        try:
            out[name] = [bytes(v).decode("utf-8") for v in values]
        except (UnicodeDecodeError, TypeError):
            raise InvalidInput(f"input {name!r}: every element must be UTF-8 text") from None
    return out


def body_of(found: Endpoint, texts: dict[str, list[str]], parameters: dict[str, Any]) -> Any:
    """The JSON route's request body for these texts and the request's parameters."""
    sig = found.signature
    body = sig.body(texts)
    options = {k: v for k, v in parameters.items() if k not in PROTOCOL_PARAMETERS}
    if sig.nested:
        if options:
            body["parameters"] = options
    else:
        clash = sorted(set(options) & set(body))
        if clash:
            raise InvalidInput(f"parameters {clash} are given by the input tensors")
        body |= options
    return body


def outputs_of(found: Endpoint, answer: Any, rows: int, asked: list[str] | None) -> list[Tensor]:
    """The answer (the JSON route's, decoded) as the output tensors named in `asked` (None:
    all of them), in the model's order."""
    specs = found.output_specs()
    if asked is not None:
        outputs_of_names(found, asked)
    typed = found.signature.tensors(answer, rows)
    items = answer if isinstance(answer, list) else [answer]
    if found.capability == "rerank":  # one answer for the request: each text's, in order
        by_index = {item["index"]: item for item in items}
        items = [by_index.get(i) for i in range(rows)]
    typed["JSON"] = np.asarray([orjson.dumps(item) for item in items], dtype=object)
    out = []
    for name, dtype, _ in specs:
        if asked is not None and name not in asked:
            continue
        data = typed[name]
        out.append(Tensor(name, dtype, list(data.shape), data))
    return out


async def infer(
    state: ServiceState,
    found: Endpoint,
    inputs: list[Tensor],
    parameters: dict[str, Any],
    asked: list[str] | None,
    stats: dict[str, Any],
    **context: Any,
) -> list[Tensor]:
    """One inference: the tensors as the JSON route's request, answered by `handle` (its
    admission slot, disconnect watch and client in `context`), the answer as tensors."""
    texts = texts_of(found, inputs)
    sig = found.signature
    rows = max(len(v) for n, v in texts.items() if n not in sig.per_request)
    body = body_of(found, texts, parameters)
    if asked is not None:  # the names are checked before any work
        outputs_of_names(found, asked)
    context["urgency"] = urgency_of(parameters, context.get("urgency", NO_URGENCY))
    answer = await handle(state, found.task, body, found.model.name, stats, **context)
    return outputs_of(found, orjson.loads(answer), rows, asked)


def urgency_of(parameters: dict[str, Any], given: Urgency) -> Urgency:
    """The request's `priority` and `timeout` (microseconds) parameters, as Triton's, over what
    its headers or metadata gave (`given`)."""
    priority, timeout = parameters.get("priority"), parameters.get("timeout")
    if timeout == 0 and not isinstance(timeout, bool):  # Triton's 0: no timeout of its own
        timeout = None
    if priority is None and timeout is None:
        return given
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
        raise InvalidInput(f"parameter timeout must be a number of microseconds; got {timeout!r}")
    if timeout is not None and timeout <= 0:
        raise InvalidInput(f"parameter timeout must be positive (microseconds); got {timeout!r}")
    asked = parse_urgency(
        None if priority is None else str(priority),
        None if timeout is None else str(timeout / 1000),
        ("parameter priority", "parameter timeout"),
    )
    seconds = asked.timeout_s if timeout is not None else given.timeout_s
    if seconds is not None and given.timeout_s is not None:  # a gRPC deadline as well
        seconds = min(seconds, given.timeout_s)
    return Urgency(asked.priority if priority is not None else given.priority, seconds, given.since)


def outputs_of_names(found: Endpoint, asked: list[str]) -> None:
    names = [n for n, _, _ in found.output_specs()]
    unknown = [n for n in asked if n not in names]
    if unknown:
        raise InvalidInput(
            f"model {found.name!r} has no output {', '.join(map(repr, unknown))}; its "
            f"outputs: {', '.join(names)}"
        )


def _bytes(values: list[str]) -> np.ndarray:
    return np.asarray([v.encode("utf-8") for v in values], dtype=object)


# --- tensor data: JSON lists and the binary form -------------------------------------------------


def from_json(name: str, datatype: str, shape: list[int], data: Any) -> Tensor:
    """A tensor from the JSON form's `data` (flat or nested, row-major)."""
    count = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        flat = list(_flatten(data))
        if not all(isinstance(v, str) for v in flat):
            raise InvalidInput(f"input {name!r}: BYTES data in JSON are strings")
        array = np.asarray([v.encode("utf-8") for v in flat], dtype=object)
    elif datatype in NUMPY:
        try:
            array = np.asarray(list(_flatten(data)), NUMPY[datatype])
        except (TypeError, ValueError):
            raise InvalidInput(f"input {name!r}: data are not {datatype}") from None
    else:
        raise InvalidInput(f"input {name!r}: datatype {datatype!r} is not served here")
    if array.size != count:
        raise InvalidInput(f"input {name!r} has shape {shape} but {array.size} elements")
    return Tensor(name, datatype, shape, array)


def from_bytes(name: str, datatype: str, shape: list[int], raw: bytes | memoryview) -> Tensor:
    """A tensor from its binary form: BYTES as 4-byte little-endian lengths each followed by
    the element, the others as little-endian values."""
    count = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        view, values, at = memoryview(raw), [], 0
        while at < len(view):
            if at + 4 > len(view):
                raise InvalidInput(f"input {name!r}: its binary data end inside a length")
            size = int.from_bytes(view[at : at + 4], "little")
            at += 4
            if at + size > len(view):
                raise InvalidInput(f"input {name!r}: its binary data end inside an element")
            values.append(bytes(view[at : at + size]))
            at += size
        array = np.asarray(values, dtype=object)
    elif datatype in NUMPY:
        dtype = np.dtype(NUMPY[datatype]).newbyteorder("<")
        if len(raw) % dtype.itemsize:
            raise InvalidInput(f"input {name!r}: {len(raw)} bytes are not whole {datatype}s")
        array = np.frombuffer(raw, dtype)
    else:
        raise InvalidInput(f"input {name!r}: datatype {datatype!r} is not served here")
    if array.size != count:
        raise InvalidInput(f"input {name!r} has shape {shape} but {array.size} elements")
    return Tensor(name, datatype, shape, array)


def to_bytes(tensor: Tensor) -> bytes:
    if tensor.datatype == "BYTES":
        return b"".join(len(v).to_bytes(4, "little") + v for v in tensor.data.reshape(-1))
    dtype = np.dtype(NUMPY[tensor.datatype]).newbyteorder("<")
    return np.ascontiguousarray(tensor.data, dtype).tobytes()


def to_json(tensor: Tensor) -> list[Any]:
    flat = tensor.data.reshape(-1)
    if tensor.datatype == "BYTES":
        return [v.decode("utf-8", "replace") for v in flat]
    return flat.tolist()


def _flatten(data: Any) -> Any:
    if isinstance(data, list):
        for item in data:
            yield from _flatten(item)
    else:
        yield data
