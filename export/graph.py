"""Task graphs: which head a task needs, the torch wrapper that exports it, and ONNX Runtime's
transformer optimisation with a count of the fused nodes.

Every graph takes `input_ids`, `attention_mask` and, where the family has segments,
`token_type_ids` (int64, dynamic batch and sequence). The fill-mask graph (with NSP beside it for
a BERT pre-training checkpoint) also takes `mask_positions` (int64, batch x predictions) and
computes vocabulary logits only there: a fill-mask request pays for its mask tokens, not for
every position. An NSP request passes one position a row.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bertserve.model.heads import BertPreTrainedModel, gather_positions, splade_pool
from bertserve.runtime.bundle import BASE_INPUTS, MASK_POSITIONS, SEGMENTS
from bertserve.runtime.capabilities import CAPABILITIES, HEAD_GRAPHS, graph_tasks, head_outputs

log = logging.getLogger(__name__)

OPSET = 17


# The head wiring, the export's own part of a capability: the checkpoint keys its head needs.
# What each capability exports (architecture, outputs, labels) is the runtime's table.
HEAD_KEYS: dict[str, tuple[str, ...]] = {
    "fill-mask": ("cls.predictions.transform.dense.weight", "cls.predictions.bias"),
    "nsp": ("cls.seq_relationship.weight",),
    "classify": ("classifier.weight",),
    "ner": ("classifier.weight",),
    "qa": ("qa_outputs.weight",),
    "embed": (),
    "rerank": ("classifier.weight",),
    "sparse": ("cls.predictions.transform.dense.weight", "cls.predictions.bias"),
    "multivector": (),  # the encoder; the projection comes from the ColBERT directory
}
TASKS = tuple(CAPABILITIES)
# Dynamic axes of the exported graph, by an output's kind.
DYNAMIC_AXES = {
    "sequence": {0: "batch"},
    "token": {0: "batch", 1: "sequence"},
    "mask": {0: "batch", 1: "predictions"},
}


def read_pooling(checkpoint: Path) -> dict[str, object]:
    """A sentence-transformers directory's pooling (1_Pooling/config.json) and whether it ends
    in a Normalize module; mean pooling, normalised, where the directory says nothing."""
    import json

    config_path = checkpoint / "1_Pooling" / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    # sentence-transformers 5 writes "pooling_mode": "mean"; earlier ones one flag a mode
    named = config.get("pooling_mode")
    if named == "cls" or config.get("pooling_mode_cls_token"):
        mode = "cls"
    elif named == "mean" or not config or config.get("pooling_mode_mean_tokens"):
        mode = "mean"
    else:
        raise ExportError(f"{config_path}: only mean or CLS pooling is supported")
    modules_path = checkpoint / "modules.json"
    modules = json.loads(modules_path.read_text()) if modules_path.is_file() else []
    normalize = not modules or any(m.get("type", "").endswith("Normalize") for m in modules)
    return {"mode": mode, "normalize": normalize}


def read_prompts(checkpoint: Path) -> dict[str, Any]:
    """A sentence-transformers directory's prompts and default prompt name
    (config_sentence_transformers.json), as bundle.json keeps them; none where it has none."""
    import json

    path = checkpoint / "config_sentence_transformers.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    prompts = {str(k): str(v) for k, v in (config.get("prompts") or {}).items()}
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ExportError(f"{path}: default_prompt_name {default!r} is not one of its prompts")
    return {"prompts": prompts, "default_prompt_name": default}


def read_sentence_settings(checkpoint: Path) -> dict[str, Any]:
    """A sentence-transformers directory's `sentence_bert_config.json`: `max_seq_length` (the
    tokens `encode` keeps) and `do_lower_case` (text lower-cased before its tokenizer runs);
    empty where the directory has none."""
    import json

    path = checkpoint / "sentence_bert_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    settings: dict[str, Any] = {}
    if config.get("max_seq_length") is not None:
        settings["max_seq_length"] = int(config["max_seq_length"])
    if config.get("do_lower_case") is not None:
        settings["do_lower_case"] = bool(config["do_lower_case"])
    return settings


def read_model_max_length(checkpoint: Path) -> int | None:
    """`tokenizer_config.json`'s `model_max_length`: where sentence-transformers 5 keeps a
    model's `max_seq_length` (and a CrossEncoder's `max_length`), and the length transformers'
    tokenizer cuts to; None where the file has none, or transformers' "no limit" placeholder."""
    import json

    path = checkpoint / "tokenizer_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("model_max_length")
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e9:
        return None
    return int(value)


class ExportError(ValueError):
    """A request the exporter cannot satisfy; the message says what to change."""


def resolve_tasks(
    requested: list[str], checkpoint_keys: set[str], architecture: str | None
) -> list[str]:
    """The tasks a bundle will declare: those asked for, plus NSP / fill-mask alongside each other
    when the checkpoint carries both pre-training heads. Fails if a head is missing."""
    unknown = [t for t in requested if t not in CAPABILITIES]
    if unknown:
        raise ExportError(f"unknown task {unknown[0]!r}; tasks are {', '.join(TASKS)}")
    tasks = list(dict.fromkeys(requested))
    if "multivector" in tasks:
        return multivector_tasks(tasks)
    if "embed" in tasks and set(tasks) & set(HEAD_GRAPHS):
        return head_tasks(tasks, checkpoint_keys)
    for task in tasks:
        missing = [k for k in HEAD_KEYS[task] if k not in checkpoint_keys]
        if missing:
            raise ExportError(f"the checkpoint has no {task} head (no {missing[0]})")
    architectures = {CAPABILITIES[t].architecture for t in tasks}
    if len(architectures) > 1 and not architectures <= PRETRAINING:
        raise ExportError(
            f"tasks {tasks} need different heads ({sorted(architectures)}): "
            "export one bundle per head"
        )
    if "sparse" in tasks and len(tasks) > 1:
        raise ExportError(
            f"tasks {tasks}: a sparse graph runs the MLM head at every position; export it as a "
            "bundle of its own"
        )
    architectures = {task_architecture(tasks)}
    if {"classify", "ner", "rerank"} & set(tasks) and architecture not in (
        None,
        *architectures,
    ):
        # classifier.weight is shared by both classification heads: the config says which.
        raise ExportError(f"the checkpoint is a {architecture}, not a {architectures.pop()}")
    if architectures & PRETRAINING and "sparse" not in tasks:
        for extra in ("fill-mask", "nsp"):
            if extra not in tasks and all(k in checkpoint_keys for k in HEAD_KEYS[extra]):
                tasks.append(extra)
    return [t for t in TASKS if t in tasks]


def multivector_tasks(tasks: list[str]) -> list[str]:
    """A multivector (ColBERT) bundle's tasks: its vectors, and /rerank by MaxSim on them."""
    if set(tasks) - {"multivector", "rerank"}:
        raise ExportError(
            f"tasks {tasks}: a multivector (ColBERT) bundle serves its vectors and MaxSim "
            "reranking only; export other heads as bundles of their own"
        )
    return [t for t in TASKS if t in ("multivector", "rerank")]


def head_tasks(tasks: list[str], checkpoint_keys: set[str]) -> list[str]:
    """A bundle of several heads over one encoder: dense vectors ("embed") and the heads of
    HEAD_GRAPHS, each exported as a graph of its own over the encoder's token states."""
    allowed = {"embed", *HEAD_GRAPHS}
    if set(tasks) - allowed:
        raise ExportError(
            f"tasks {tasks}: a bundle of several heads over one encoder carries "
            f"{', '.join(sorted(allowed))}; export other heads as bundles of their own"
        )
    for task in tasks:
        missing = [k for k in HEAD_KEYS[task] if k not in checkpoint_keys]
        if missing:
            raise ExportError(f"the checkpoint has no {task} head (no {missing[0]})")
    return [t for t in TASKS if t in tasks]


# The two heads of a BERT pre-training checkpoint: one graph serves fill-mask and NSP.
PRETRAINING = {"BertForMaskedLM", "BertForPreTraining"}


def task_architecture(tasks: list[str]) -> str:
    """The head class a bundle of `tasks` loads: NSP needs BERT's pre-training heads."""
    if "multivector" in tasks:
        return CAPABILITIES["multivector"].architecture
    if head_outputs(tasks):  # the encoder and the heads' weights (an MLM head for SPLADE)
        return CAPABILITIES[next(t for t in tasks if t in HEAD_GRAPHS)].architecture
    return "BertForPreTraining" if "nsp" in tasks else CAPABILITIES[tasks[0]].architecture


def output_axes(tasks: list[str]) -> dict[str, str]:
    return {
        name: kind for t in graph_tasks(tasks) for name, kind in CAPABILITIES[t].outputs.items()
    }


def graph_io(tasks: list[str], segments: bool = True) -> tuple[list[str], list[str]]:
    """The graph's input and output names; `segments`: the family has token_type_ids."""
    axes = output_axes(tasks)
    base = [i for i in BASE_INPUTS if segments or i != SEGMENTS]
    inputs = base + ([MASK_POSITIONS] if "mask" in axes.values() else [])
    return inputs, list(axes)


# The heads of the encoders written apart from model/bert.py (ModernBERT: model/modernbert.py,
# DeBERTa-v2/v3: model/deberta.py), by their class names' ending: the tasks each serves.
OWN_HEADS = {
    "ForMaskedLM": ("fill-mask", "sparse"),
    "ForSequenceClassification": ("classify", "rerank"),
    "ForTokenClassification": ("ner",),
    "ForQuestionAnswering": ("qa",),
    "Model": ("embed",),
}
OWN_ENCODERS = ("ModernBert", "DebertaV2")


def own_tasks(requested: list[str], architecture: str | None) -> list[str]:
    """The tasks a bundle of one of OWN_ENCODERS declares: those asked for, if its head serves
    them (one head a bundle; neither has an NSP head); any checkpoint's encoder embeds."""
    unknown = [t for t in requested if t not in CAPABILITIES]
    if unknown:
        raise ExportError(f"unknown task {unknown[0]!r}; tasks are {', '.join(TASKS)}")
    if "multivector" in requested:  # any checkpoint's encoder, projected
        return multivector_tasks(requested)
    if head_outputs(requested):
        raise ExportError(
            f"tasks {requested}: several heads over one encoder are exported for the families "
            f"of model/bert.py; a {architecture} exports one head a bundle"
        )
    suffix = next((s for s in OWN_HEADS if architecture and architecture.endswith(s)), "Model")
    served = OWN_HEADS[suffix]
    if all(t == "embed" for t in requested):
        served = (*served, "embed")
    missing = [t for t in requested if t not in served]
    if missing:
        raise ExportError(
            f"the checkpoint is a {architecture}, which serves {', '.join(served)}; "
            f"not {missing[0]}"
        )
    return [t for t in TASKS if t in requested]


class TaskGraph(nn.Module):
    """Positional tensors in, the tasks' outputs out: the module `torch.onnx.export` traces."""

    def __init__(
        self,
        model: BertPreTrainedModel,
        tasks: list[str],
        pooling: str = "mean",
        sparse: dict[str, Any] | None = None,
        projection: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        # A multivector graph's projection (PyLate's Dense layers: export/colbert.py)
        self.projection = projection
        self.tasks = tasks
        self.pooling = pooling
        # SPLADE's pooling and activation (bundle.json "sparse"), for a sparse graph
        self.sparse = sparse or {"pooling": "max", "activation": "relu"}
        self.segments = model.config.family.segments
        self.eval()  # an inference graph: the exporter restores this mode after tracing

    def forward(self, *feeds: Tensor) -> tuple[Tensor, ...]:
        """`feeds` in graph_io's order: input_ids, attention_mask, [token_type_ids],
        [mask_positions]."""
        input_ids, attention_mask, *rest = feeds
        token_type_ids = rest.pop(0) if self.segments else None
        mask_positions = rest.pop(0) if rest else None
        m: Any = self.model  # its heads depend on the architecture, dispatched on below
        arch = m.architecture
        if arch.startswith(OWN_ENCODERS):
            return self.own(m, input_ids, attention_mask, token_type_ids, mask_positions)
        if "embed" in self.tasks and arch != "BertModel":  # the encoder of a head's model
            sequence, _ = m.bert(input_ids, attention_mask, token_type_ids)  # (B, S, H)
            pooled = self.pooled(sequence, attention_mask)
            if "sparse" in self.tasks:  # the whole bundle of heads, for parity
                return (*pooled, self.splade(m.cls.predictions(sequence), attention_mask))
            return pooled
        if "multivector" in self.tasks:  # every position, projected and normalised
            sequence, _ = m.bert(input_ids, attention_mask, token_type_ids)
            return (self.vectors(sequence),)
        if "sparse" in self.tasks:  # every position's vocabulary logits, SPLADE-pooled
            sequence, _ = m.bert(input_ids, attention_mask, token_type_ids)  # (B, S, H)
            return (self.splade(m.cls.predictions(sequence), attention_mask),)
        if arch in PRETRAINING:
            sequence, pooled = m.bert(input_ids, attention_mask, token_type_ids)
            outs = []
            if "fill-mask" in self.tasks:
                assert mask_positions is not None, "a fill-mask graph takes mask_positions"
                outs.append(m.cls.predictions(gather_positions(sequence, mask_positions)))
            if "nsp" in self.tasks:
                outs.append(m.cls.seq_relationship(pooled))
            return tuple(outs)
        if arch == "BertForQuestionAnswering":
            out = m(input_ids, attention_mask, token_type_ids)
            return out.start_logits, out.end_logits
        if arch == "BertModel":  # embeddings: the last hidden states, pooled, and themselves
            sequence, _ = m.bert(input_ids, attention_mask, token_type_ids)  # (B, S, H)
            return self.pooled(sequence, attention_mask)
        return (m(input_ids, attention_mask, token_type_ids).logits,)

    def own(
        self,
        m: Any,
        input_ids: Tensor,
        attention_mask: Tensor,
        token_type_ids: Tensor | None,
        mask_positions: Tensor | None,
    ) -> tuple[Tensor, ...]:
        """The heads of OWN_ENCODERS as the same graph outputs."""
        segments = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        if "multivector" in self.tasks:
            return (self.vectors(m(input_ids, attention_mask, **segments)),)
        if "embed" in self.tasks:  # the bare encoder: its last hidden states
            return self.pooled(m(input_ids, attention_mask, **segments), attention_mask)
        if "fill-mask" in self.tasks:
            assert mask_positions is not None, "a fill-mask graph takes mask_positions"
            return (m(input_ids, attention_mask, **segments, positions=mask_positions),)
        if "sparse" in self.tasks:
            return (self.splade(m(input_ids, attention_mask, **segments), attention_mask),)
        out = m(input_ids, attention_mask, **segments)
        return out if isinstance(out, tuple) else (out,)

    def vectors(self, sequence: Tensor) -> Tensor:
        """(B, S, H) token states -> (B, S, D) unit vectors through the projection."""
        assert self.projection is not None, "a multivector graph has a projection"
        return torch.nn.functional.normalize(self.projection(sequence), p=2, dim=-1)

    def splade(self, logits: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, S, V) logits -> (B, V) SPLADE weights, as the bundle's "sparse" says."""
        return splade_pool(
            logits, attention_mask, self.sparse["pooling"], self.sparse["activation"]
        )

    def pooled(self, sequence: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        """An embedding graph's outputs: the pooled vector and the token states."""
        if self.pooling == "cls":
            return sequence[:, 0], sequence
        weights = attention_mask.unsqueeze(-1).to(sequence.dtype)  # (B, S, 1)
        summed = (sequence * weights).sum(1)  # (B, H)
        return summed / weights.sum(1).clamp(min=1e-9), sequence


class HeadGraph(nn.Module):
    """A head of a bundle of several (HEAD_GRAPHS) over the encoder's token states:
    (token_embeddings, attention_mask) in, the head's output out."""

    def __init__(self, graph: TaskGraph, task: str) -> None:
        super().__init__()
        self.graph, self.task = graph, task

    def forward(self, states: Tensor, attention_mask: Tensor) -> Tensor:
        m: Any = self.graph.model
        assert self.task == "sparse", "the sparse head is the one head graph"
        return self.graph.splade(m.cls.predictions(states), attention_mask)


def export_head(graph: TaskGraph, task: str, path: Path) -> None:
    """A head's graph of its own (bundle.json "heads"), traced over float token states."""
    hidden = graph.model.config.hidden_size
    states = torch.randn(2, 8, hidden)
    mask = torch.ones((2, 8), dtype=torch.long)
    mask[-1, 4:] = 0
    output = HEAD_GRAPHS[task]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            HeadGraph(graph, task),
            (states, mask),
            str(path),
            input_names=["token_embeddings", "attention_mask"],
            output_names=[output],
            dynamic_axes={
                "token_embeddings": {0: "batch", 1: "sequence"},
                "attention_mask": {0: "batch", 1: "sequence"},
                output: DYNAMIC_AXES[CAPABILITIES[task].outputs[output]],
            },
            opset_version=OPSET,
            # the tied decoder's transpose folded into its weight: a MatMul on a constant, which
            # the int8 quantiser (export.variants.to_int8) then quantises
            do_constant_folding=True,
            dynamo=False,
        )


def example_inputs(
    tasks: list[str], segments: bool = True, batch: int = 2, seq: int = 8
) -> tuple[Tensor, ...]:
    ids = torch.full((batch, seq), 7, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[-1, seq // 2 :] = 0
    args = [ids, mask] + ([torch.zeros_like(ids)] if segments else [])
    if MASK_POSITIONS in graph_io(tasks)[0]:
        args.append(torch.ones((batch, 2), dtype=torch.long))
    return tuple(args)


def export_onnx(
    model: BertPreTrainedModel,
    tasks: list[str],
    path: Path,
    pooling: str = "mean",
    sparse: dict[str, Any] | None = None,
    projection: nn.Module | None = None,
) -> None:
    """Trace with the TorchScript exporter: its graph is the one ONNX Runtime's BERT fusions
    recognise (Attention, SkipLayerNormalization, BiasGelu)."""
    segments = model.config.family.segments
    heads = [t for t in tasks if t in HEAD_GRAPHS] if head_outputs(tasks) else []
    tasks = [t for t in tasks if t not in heads]  # the model graph; the heads' are apart
    inputs, outputs = graph_io(tasks, segments)
    axes = {name: {0: "batch", 1: "sequence"} for name in BASE_INPUTS if name in inputs}
    if MASK_POSITIONS in inputs:
        axes[MASK_POSITIONS] = {0: "batch", 1: "predictions"}
    axes |= {name: DYNAMIC_AXES[kind] for name, kind in output_axes(tasks).items()}
    graph = TaskGraph(model, tasks, pooling, sparse, projection)
    for task in heads:
        export_head(TaskGraph(model, [*tasks, task], pooling, sparse), task, head_file(path, task))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(
            graph,
            example_inputs(tasks, segments),
            str(path),
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes,
            opset_version=OPSET,
            do_constant_folding=False,
            dynamo=False,
        )


def head_file(path: Path, task: str) -> Path:
    """Where the graph of a head of a bundle of several sits beside its model graph `path`."""
    return path.with_name(f"{path.stem}.{task}-head{path.suffix}")


FUSED_OPS = (
    "Attention",
    "SkipLayerNormalization",
    "BiasGelu",
    "FastGelu",
    "Gelu",
    "EmbedLayerNormalization",
    "LayerNormalization",
)


def optimise(src: Path, dst: Path, num_heads: int, hidden_size: int) -> dict[str, int]:
    """ONNX Runtime's offline BERT optimiser; returns how many nodes of each fused kind it made."""
    from onnxruntime.transformers.optimizer import optimize_model

    quiet = logging.getLogger("onnxruntime.transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        optimised = optimize_model(
            str(src), model_type="bert", num_heads=num_heads, hidden_size=hidden_size, opt_level=0
        )
    finally:
        quiet.setLevel(level)
    optimised.save_model_to_file(str(dst))
    return fused_counts(dst)


def fused_counts(path: Path) -> dict[str, int]:
    import onnx

    counts = Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
    return {op: counts[op] for op in FUSED_OPS if counts[op]}
