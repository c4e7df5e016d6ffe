"""The one task vocabulary: what a bundle can do (bundle.json "tasks"), torch-free.

Each capability names the graph outputs it exports and their axes, the model class that carries
its head, whether it needs labels, how it is trained and how it is evaluated. Everything else
derives from this table: the endpoints that serve a capability (runtime/tasks/), the head wiring
of the export (export/graph.py), the training commands' choices and the evaluators
(model/training/); tests/runtime/test_task_table.py fails when one of them names a capability
this table lacks, or the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Training = Literal["pretrain", "finetune", "rerank", "none"]


@dataclass(frozen=True)
class Capability:
    name: str
    architecture: str  # the model class that carries the head (model/heads.py HEADS)
    outputs: dict[str, str]  # graph output -> its axes (bundle.json "output_axes")
    labelled: bool  # needs id2label (bundle.json "labels")
    training: Training  # the command that trains its head: `bertserve <training>`
    evaluations: tuple[str, ...]  # `bertserve evaluate --task ...` names that measure it


def _table(*capabilities: Capability) -> dict[str, Capability]:
    return {c.name: c for c in capabilities}


CAPABILITIES = _table(
    # A BERT pre-training checkpoint serves it beside NSP (BertForPreTraining).
    Capability(
        name="fill-mask",
        architecture="BertForMaskedLM",
        outputs={"mlm_logits": "mask"},
        labelled=False,
        training="pretrain",
        evaluations=("mlm", "mlm-news"),
    ),
    Capability(
        name="nsp",
        architecture="BertForPreTraining",
        outputs={"nsp_logits": "sequence"},
        labelled=False,
        training="pretrain",
        evaluations=("nsp", "nsp-news"),
    ),
    Capability(
        name="classify",
        architecture="BertForSequenceClassification",
        outputs={"logits": "sequence"},
        labelled=True,
        training="finetune",
        evaluations=("classify",),
    ),
    Capability(
        name="ner",
        architecture="BertForTokenClassification",
        outputs={"logits": "token"},
        labelled=True,
        training="finetune",
        evaluations=("ner",),
    ),
    Capability(
        name="qa",
        architecture="BertForQuestionAnswering",
        outputs={"start_logits": "token", "end_logits": "token"},
        labelled=False,
        training="finetune",
        evaluations=("qa",),
    ),
    # The encoder alone, mean-pooled (a sentence-transformers bi-encoder), trained elsewhere,
    # and its last hidden states (late chunking: runtime/tasks/chunks.py).
    Capability(
        name="embed",
        architecture="BertModel",
        outputs={"embeddings": "sequence", "token_embeddings": "token"},
        labelled=False,
        training="none",
        evaluations=("embed",),
    ),
    # A cross-encoder: a sequence classifier with one output (sentence-transformers' CrossEncoder).
    Capability(
        name="rerank",
        architecture="BertForSequenceClassification",
        outputs={"logits": "sequence"},
        labelled=False,
        training="rerank",
        evaluations=("rerank",),
    ),
    # Sparse (SPLADE) vectors: the MLM head at every position, log(1 + ReLU(logits)) pooled
    # over the text's tokens, one weight a vocabulary entry (sentence-transformers'
    # SparseEncoder); its query side may be a learned weight a token, run without the encoder
    # (bundle.json "sparse").
    Capability(
        name="sparse",
        architecture="BertForMaskedLM",
        outputs={"sparse_embeddings": "sequence"},
        labelled=False,
        training="none",
        evaluations=("retrieval",),
    ),
    # Multi-vector (ColBERT) vectors: every position's last hidden state projected and
    # normalised (PyLate's ColBERT; bundle.json "multivector" frames its texts). Such a bundle
    # declares "rerank" too: /rerank scores its documents by MaxSim on these vectors; its graph
    # has this output only (`graph_tasks`).
    Capability(
        name="multivector",
        architecture="BertModel",
        outputs={"multivector_embeddings": "token"},
        labelled=False,
        training="none",
        evaluations=(),
    ),
)


def graph_tasks(tasks: list[str]) -> list[str]:
    """The tasks whose heads a bundle's graph computes: a multivector bundle's "rerank" is
    MaxSim on its vectors, not a head of its own."""
    return [t for t in tasks if not (t == "rerank" and "multivector" in tasks)]


# Heads a bundle may carry over one encoder beside its dense vectors ("embed"), each in a graph
# of its own over the encoder's token states (bundle.json "heads"), run only for a call that
# asks for its output: the capability -> that output. A request may ask for several at once
# (POST /encode: runtime/tasks/encode.py); the encoder runs once for them all.
HEAD_GRAPHS = {"sparse": "sparse_embeddings"}


def head_outputs(tasks: list[str]) -> list[str]:
    """The outputs of a bundle of `tasks` computed by head graphs of their own: a dense
    bundle's further heads; none for a bundle of one head."""
    if "embed" not in tasks:
        return []
    return [output for task, output in HEAD_GRAPHS.items() if task in tasks]


# Outputs a model call computes only for a batch holding a row that asks for them
# (`runtime.batching.Row.wants`): a batch's token states are rows x length x hidden floats, which
# every other call of the graph would copy out for nothing.
ON_DEMAND = frozenset({"token_embeddings"})


def trained_by(training: Training) -> list[str]:
    """The capabilities whose heads `bertserve <training>` trains, in the table's order."""
    return [c.name for c in CAPABILITIES.values() if c.training == training]


def evaluations() -> dict[str, str]:
    """Every evaluation name -> the capability it measures."""
    return {e: c.name for c in CAPABILITIES.values() for e in c.evaluations}
