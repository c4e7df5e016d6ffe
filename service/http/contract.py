"""The OpenAPI document as this deployment's contract: the static schema (request models, strict
types, bounds) with what the settings and the loaded models decide written into it, so that a
body the document allows is a body the service accepts.

- how many items one request may carry (`BERTSERVE_MAX_CLIENT_BATCH`, and
  `BERTSERVE_MAX_RERANK_DOCUMENTS` for rerank documents): `maxItems`;
- the mask token a /fill-mask input must contain: a `pattern` (the served models' tokens);
- the prompts `prompt_name` may name: an `enum` (the bundles' declared prompts);
- the token ids /decode and OpenAI's token-id inputs may hold: `maximum` (the smallest served
  vocabulary, less one), and for OpenAI's `not` the ids no text tokenises to;
- the `dimensions` an embedding may be cut to: `maximum` (the narrowest embedding model's
  width);
- the pieces a chunk of /embed/chunks may hold: `maximum` (the narrowest window less its
  special tokens);
- the quantised types an embedding may take: int8 and uint8 only where every embedding model
  has its calibration (bundle.json `quantization`).

What a schema still cannot state is per model: a request that picks a model with `?model=`
may meet that model's own mask token, prompts and vocabulary, and a text's length in tokens
is known only once it is tokenised; int8 asks for a width the model is calibrated at, and for
unit vectors, which depends on other fields. Those get a 4xx that names the limit."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from bertserve.runtime.tasks import TASKS
from bertserve.runtime.tasks.chunks import room
from bertserve.service.models import Model, serving
from bertserve.service.settings import Settings

JsonSchema = dict[str, Any]

# Request bodies outside the task registry whose lists count against max_client_batch.
ROUTE_ITEMS = {"TokenizeRequest": ("inputs",), "DecodeRequest": ("ids",)}


def bind(schema: JsonSchema, settings: Settings, models: dict[str, Model]) -> JsonSchema:
    """`schema` (FastAPI's document) with the deployment's limits written in, in place."""
    components = schema.get("components", {}).get("schemas", {})
    by_task = serving(models)
    for task in TASKS.values():
        name = task.request.__name__
        most = settings.request_limits[task.batch_limit] - task.items_besides
        for node in resolve(components, components.get(name), task.items_field):
            limit_items(node, most)
    for name, path in ROUTE_ITEMS.items():
        for node in resolve(components, components.get(name), path):
            limit_items(node, settings.max_client_batch)

    fill_mask = [models[n] for n in by_task.get("fill-mask", [])]
    masks = sorted({m.spec.tokenizer.mask_token for m in fill_mask})
    if masks:
        pattern = "|".join(re.escape(mask) for mask in masks)
        for node in resolve(components, components.get("FillMaskRequest"), ("inputs",)):
            for text in strings(node):
                text["pattern"] = pattern

    prompts = sorted({p for m in models.values() for p in m.spec.prompts})
    for component in components.values():
        field = component.get("properties", {}).get("prompt_name")
        if field is not None:
            named = [{"type": "string", "enum": prompts}] if prompts else []
            field.pop("type", None)
            field["anyOf"] = [*named, {"type": "null"}]

    # (component, field, the bundle task whose models read the ids; None: any model)
    for name, field, capability in (
        ("DecodeRequest", "ids", None),
        ("OpenAIEmbeddingsRequest", "input", "embed"),
    ):
        names = by_task.get(capability, []) if capability else list(models)
        chosen = [models[n] for n in names]
        if not chosen:
            continue
        top = min(m.spec.tokenizer.vocab_size for m in chosen) - 1
        # Embedding inputs: not the ids no text tokenises to, which are refused as another
        # tokenizer's (runtime.tasks.common.TaskContext.foreign_ids).
        foreign = sorted({i for m in chosen for i in m.ctx.foreign_ids}) if capability else []
        for node in resolve(components, components.get(name), (field,)):
            for ids in integers(node):
                ids["maximum"] = top
                if foreign:
                    ids["not"] = {"enum": foreign}

    # `dimensions` is at most the served embedding models' width (the narrowest).
    embedders = [models[n] for n in by_task.get("embed", [])]
    if embedders:
        width = min(m.spec.architecture.hidden_size for m in embedders)
        for name, field in DIMENSIONS:
            for node in resolve(components, components.get(name), (field,)):
                if node.get("type") == "integer":
                    node["maximum"] = width
        # A chunk is at most what the narrowest window holds beside its special tokens (a
        # prompt takes more: per model, a 422 that names it).
        most = min(room(m.ctx) for m in embedders)
        for node in resolve(components, components.get("EmbedChunksRequest"), ("chunk_tokens",)):
            node["maximum"] = most
            node["default"] = min(node.get("default", most), most)
    if not all(m.ctx.ranges for m in embedders):  # int8 / uint8 need every model calibrated
        for name, field in EMBEDDING_TYPES:
            for node in resolve(components, components.get(name), (field,)):
                for enum in enums(node):
                    enum["enum"] = [v for v in enum["enum"] if v not in ("int8", "uint8")]
    return schema


# Where an embedding's width and its quantised types are asked for: (component, field).
DIMENSIONS = (
    ("EmbedRequest", "dimensions"),
    ("OpenAIEmbeddingsRequest", "dimensions"),
    ("EmbedChunksRequest", "dimensions"),
    ("EncodeRequest", "dimensions"),
    ("CohereEmbedRequest", "output_dimension"),
)
EMBEDDING_TYPES = (
    ("EmbedRequest", "embedding_type"),
    ("OpenAIEmbeddingsRequest", "embedding_type"),
    ("CohereEmbedRequest", "embedding_types"),
)


def resolve(
    components: JsonSchema, node: JsonSchema | None, path: Iterable[str]
) -> list[JsonSchema]:
    """The schema nodes at `path` (property names) below `node`, through $refs."""
    nodes = [node] if node is not None else []
    for name in path:
        nodes = [
            child
            for n in nodes
            for ref in variants(components, n)
            if (child := ref.get("properties", {}).get(name)) is not None
        ]
    return [leaf for n in nodes for leaf in variants(components, n)]


def variants(components: JsonSchema, node: JsonSchema) -> Iterator[JsonSchema]:
    """A node, its anyOf branches, and what their $refs point at."""
    if "$ref" in node:
        yield from variants(components, components[node["$ref"].rsplit("/", 1)[-1]])
    elif "anyOf" in node:
        for branch in node["anyOf"]:
            yield from variants(components, branch)
    else:
        yield node


def limit_items(node: JsonSchema, most: int) -> None:
    """maxItems on a list of items; a bare list of token ids is one item, left as it is."""
    if node.get("type") == "array" and node.get("items", {}).get("type") != "integer":
        node["maxItems"] = most


def strings(node: JsonSchema) -> Iterator[JsonSchema]:
    if node.get("type") == "string":
        yield node
    elif node.get("type") == "array":
        yield from (s for s in [node.get("items", {})] if s.get("type") == "string")


def enums(node: JsonSchema) -> Iterator[JsonSchema]:
    """The string enums in `node`: itself, its anyOf variants', its items'."""
    if "enum" in node:
        yield node
    for key in ("anyOf", "oneOf"):
        for variant in node.get(key, []):
            yield from enums(variant)
    if isinstance(node.get("items"), dict):
        yield from enums(node["items"])


def integers(node: JsonSchema) -> Iterator[JsonSchema]:
    """The integer schemas of a list of ids, or of a list of such lists."""
    items = node.get("items", {}) if node.get("type") == "array" else {}
    if items.get("type") == "integer":
        yield items
    elif items.get("type") == "array":
        yield from integers(items)
