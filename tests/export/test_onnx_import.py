"""ONNX encoders we did not write, read back into checkpoints (export/onnx_import.py): for a
random-weight cross-encoder of each supported family, exported by torch.onnx alone (a bare graph,
no config.json: every dimension read or tried) and by Optimum (its folder, config.json beside
it), each fp32 and dynamic int8 (ONNX Runtime's quantiser), the imported bundle answers as the
original model within the graph's own rounding. What cannot be read is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers

from bertserve.export.__main__ import main
from bertserve.export.bundle import build_bundle
from bertserve.export.onnx_import import checkpoint_from_onnx, is_onnx_source
from bertserve.export.parity import sample_feeds
from bertserve.export.recover import RecoverError
from bertserve.model.checkpoint import read_config, sha256
from bertserve.model.tokenizer import BertTokenizer
from tests.helpers.checkpoints import cross_encoder
from tests.helpers.families import family_checkpoint

pytestmark = pytest.mark.slow
FAMILIES = ["bert", "distilbert", "roberta", "xlm-roberta", "electra"]
PAIRS = [
    ("who was the first king of france ?", "He was born in Paris, the first city of France."),
    ("a dull movie", "The film was good, and the cast was great."),
    ("paris", "The dog and the fox went to London."),
]
SEGMENTS = {"bert", "electra"}  # the families whose graphs take token_type_ids


def original(root: Path, family: str) -> Path:
    """A random cross-encoder of `family`, every weight nudged off its initial value (so that a
    weight read into the wrong place shows) and its attention made as peaked as a trained
    model's (random attention is near uniform, whatever the head count), saved with its
    tokenizer."""
    if family == "bert":
        directory = cross_encoder(root / "bert-rerank")
        transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(
            directory
        )
    else:
        directory = family_checkpoint(root, family, "rerank")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory)
    torch.manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.05 * torch.randn_like(param))
            if name.endswith(("query.weight", "key.weight", "q_lin.weight", "k_lin.weight")):
                param.mul_(6)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def feeds(tokenizer: BertTokenizer, names: list[str]) -> dict[str, np.ndarray]:
    texts, pairs = zip(*PAIRS, strict=True)
    return sample_feeds(tokenizer, texts, names, 64, pairs=pairs)


def torch_onnx(directory: Path, out: Path, family: str) -> Path:
    """A plain `torch.onnx.export` of the model: one graph file, nothing beside it."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    names = ["input_ids", "attention_mask", *(["token_type_ids"] if family in SEGMENTS else [])]
    return export_head(model, out, ["logits"], names)


def optimum(directory: Path, out: Path) -> Path:
    from optimum.exporters.onnx import main_export

    main_export(str(directory), output=str(out), task="text-classification", device="cpu")
    return out


def int8(graph: Path, out: Path) -> Path:
    """ONNX Runtime's dynamic quantiser, as published int8 graphs are made (MatMuls and the
    embedding tables in int8)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out.parent.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "special_tokens_map.json", "vocab.txt"):
        if (graph.parent / name).is_file():
            shutil.copyfile(graph.parent / name, out.parent / name)
    quantize_dynamic(str(graph), str(out), weight_type=QuantType.QInt8)
    return out


def run(graph: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    return np.asarray(session.run(None, {k: v for k, v in inputs.items() if k in wanted})[0])


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("onnx-sources")
    made: dict[str, dict[str, Path]] = {}
    for family in FAMILIES:
        directory = original(root / "checkpoints", family)
        plain = torch_onnx(directory, root / family / "torch" / "model.onnx", family)
        folder = optimum(directory, root / family / "optimum")
        made[family] = {
            "checkpoint": directory,
            "torch-fp32": plain,
            "torch-int8": int8(plain, root / family / "torch-int8" / "model.onnx"),
            "optimum-fp32": folder,
            "optimum-int8": int8(folder / "model.onnx", root / family / "optimum-int8" / "q.onnx"),
        }
    return made


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["torch-fp32", "torch-int8", "optimum-fp32", "optimum-int8"])
def test_imported_bundle_answers_as_the_original(sources, family, layout, tmp_path):
    made = sources[family]
    source = made[layout]
    tokenizer = made["checkpoint"] if layout.startswith("torch") else None
    report = checkpoint_from_onnx(source, tmp_path / "ckpt", tokenizer=tokenizer)
    config = read_config(tmp_path / "ckpt")
    expected = json.loads((made["checkpoint"] / "config.json").read_text())
    # Optimum's folder says its family; a bare graph's is read from the weights' names, which
    # XLM-RoBERTa shares with RoBERTa (the same encoder).
    inferred = "roberta" if family == "xlm-roberta" else family
    assert config.model_type == (inferred if layout.startswith("torch") else expected["model_type"])
    assert config.num_attention_heads == 4 and config.num_hidden_layers == 2
    assert report["heads_from"] == (
        "outputs compared" if layout.startswith("torch") else "config.json"
    )
    assert report["quantised"] == layout.endswith("int8")

    spec = build_bundle(tmp_path / "ckpt", ["rerank"], tmp_path / "bundle")
    tok = BertTokenizer.load(made["checkpoint"])
    names = ["input_ids", "attention_mask", "token_type_ids"]
    inputs = feeds(tok, names)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(
        made["checkpoint"]
    ).eval()
    with torch.no_grad():
        kwargs = {k: torch.from_numpy(v) for k, v in inputs.items()}
        if family not in SEGMENTS:
            kwargs.pop("token_type_ids")
        truth = reference(**kwargs).logits.numpy()
    ours = run(tmp_path / "bundle" / spec.model_file, inputs)
    graph = run(source if source.suffix == ".onnx" else source / "model.onnx", inputs)
    scale = np.abs(truth).max()
    # An fp32 graph is the model: the bundle answers as it to float rounding. An int8 graph
    # rounded the weights: the bundle keeps that rounding (its weights, dequantised) and computes
    # the rest in fp32, so its distance from the original is of the int8 graph's own.
    own = np.abs(graph - truth).max()
    bound = 1e-4 * scale if layout.endswith("fp32") else 4 * own + 1e-3 * scale
    assert np.abs(ours - truth).max() <= bound, (np.abs(ours - truth).max(), own, scale)
    # The same order wherever the original's scores stand further apart than the bound lets
    # them move. With fp32 the bound is float rounding and the order is checked; with int8 the
    # graph's own rounding spans the random weights' scores (an order check there failed in a
    # full run: [2, 0, 1] against [0, 2, 1]).
    apart = truth[:, 0][:, None] - truth[:, 0][None, :] > 2 * bound
    assert (ours[:, 0][:, None] > ours[:, 0][None, :])[apart].all()
    assert apart.any() or layout.endswith("int8")


def test_export_takes_an_onnx_source_and_names_it(sources, tmp_path, capsys):
    """`bertserve export --checkpoint` reads an ONNX folder back first, and bundle.json names
    the folder and the graph it came from."""
    folder = sources["bert"]["optimum-int8"].parent
    assert is_onnx_source(folder) and not is_onnx_source(sources["bert"]["checkpoint"])
    assert (
        main(["--checkpoint", str(folder), "--task", "rerank", "--out", str(tmp_path / "b")]) == 0
    )
    bundle = json.loads((tmp_path / "b" / "bundle.json").read_text())
    assert bundle["source"]["checkpoint"] == str(folder)
    assert bundle["source"]["init"]["origin"] == str(folder / "q.onnx")
    assert bundle["source"]["init"]["sha256"] == sha256(folder / "q.onnx")


def test_what_cannot_be_read_is_refused_in_one_line(sources, tmp_path, capsys):
    made = sources["bert"]
    plain = made["torch-fp32"]
    # no tokenizer beside a bare graph
    with pytest.raises(RecoverError, match="--tokenizer"):
        checkpoint_from_onnx(plain, tmp_path / "a")
    # a head count that is not the graph's: its answers differ, and the import says so
    with pytest.raises(RecoverError, match="no reading answers as the graph does"):
        checkpoint_from_onnx(plain, tmp_path / "b", tokenizer=made["checkpoint"], heads=2)
    # an ONNX Runtime-optimised graph
    from onnxruntime.transformers.optimizer import optimize_model

    fused = optimize_model(str(plain), "bert", num_heads=4, hidden_size=32)
    fused.save_model_to_file(str(tmp_path / "fused.onnx"))
    with pytest.raises(RecoverError, match="optimised graph"):
        checkpoint_from_onnx(tmp_path / "fused.onnx", tmp_path / "c", tokenizer=made["checkpoint"])
    # a folder with two graphs
    two = tmp_path / "two"
    two.mkdir()
    shutil.copyfile(plain, two / "a.onnx")
    shutil.copyfile(plain, two / "b.onnx")
    with pytest.raises(RecoverError, match="several graphs"):
        checkpoint_from_onnx(two, tmp_path / "d")
    # through the CLI: one line on stderr, exit status 2
    code = main(["checkpoint", str(plain), "--out", str(tmp_path / "e")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err


def test_another_architectures_graph_is_refused_naming_its_weights(sources, tmp_path):
    """An MPNet cross-encoder's graph (weights `mpnet.*`) is no family this reader maps: refused
    naming its weights and the families read, not as a head it failed to find."""
    config = transformers.MPNetConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=37,
        num_labels=1,
    )
    torch.manual_seed(0)
    model = transformers.MPNetForSequenceClassification(config).eval()
    graph = export_head(model, tmp_path / "mpnet.onnx", ["logits"], ["input_ids", "attention_mask"])
    with pytest.raises(RecoverError, match=r"mpnet\.\*, no family this reader maps"):
        checkpoint_from_onnx(graph, tmp_path / "out", tokenizer=sources["bert"]["checkpoint"])


def test_a_head_count_the_answers_cannot_tell_is_left_to_the_user(sources, tmp_path):
    """With query and key weights of zero every head attends evenly, so every head count
    answers alike: refused naming the two closest readings, and --heads settles it."""
    directory = tmp_path / "flat"
    shutil.copytree(sources["bert"]["checkpoint"], directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("query.weight", "query.bias", "key.weight", "key.bias")):
                param.zero_()
    model.save_pretrained(directory, safe_serialization=True)
    graph = torch_onnx(directory, tmp_path / "flat.onnx", "bert")
    with pytest.raises(RecoverError, match="two readings answer") as refused:
        checkpoint_from_onnx(graph, tmp_path / "a", tokenizer=directory)
    assert str(refused.value).count("'heads'") == 2
    report = checkpoint_from_onnx(graph, tmp_path / "b", tokenizer=directory, heads=4)
    assert report["heads"] == 4 and report["heads_from"] == "--heads"


def test_a_weight_without_a_module_path_is_refused_by_name(sources, tmp_path):
    """A graph whose weight-holding node lost its torch module path (a renamed node) cannot be
    read by name, and the import names the node."""
    made = sources["bert"]
    proto = onnx.load(str(made["torch-fp32"]))
    matmul = next(n for n in proto.graph.node if n.op_type == "MatMul" and "query" in n.name)
    matmul.name = "renamed_matmul"
    onnx.save(proto, str(tmp_path / "renamed.onnx"))
    with pytest.raises(RecoverError, match="renamed_matmul"):
        checkpoint_from_onnx(
            tmp_path / "renamed.onnx", tmp_path / "x", tokenizer=made["checkpoint"]
        )


def test_the_command_records_the_provenance_it_is_given(sources, tmp_path, capsys):
    made = sources["bert"]
    code = main(
        [
            "checkpoint",
            str(made["torch-int8"]),
            "--out",
            str(tmp_path / "ckpt"),
            "--tokenizer",
            str(made["checkpoint"]),
            "--name",
            "someone/tiny-cross-encoder",
            "--license",
            "mit",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["heads"] == 4 and report["quantised"] and report["heads_from"] == "outputs compared"
    )
    source = json.loads((tmp_path / "ckpt" / "source.json").read_text())
    assert source["name"] == "someone/tiny-cross-encoder" and source["license"] == "mit"
    assert source["origin"] == str(made["torch-int8"])
    assert (
        json.loads((tmp_path / "ckpt" / "imported.json").read_text())["sha256"]
        == (source["sha256"])
    )


HEAD_CASES = {
    # HF class, graph outputs, a transformers output to compare, our architecture
    "BertForQuestionAnswering": (["start_logits", "end_logits"], "start_logits"),
    "BertForMaskedLM": (["logits"], "logits"),
    "BertForTokenClassification": (["logits"], "logits"),
}


def bert(
    root: Path, cls: str, labels: int = 5, **config
) -> tuple[Path, transformers.PreTrainedModel]:
    """A tiny random BERT of `cls`, nudged and peaked as `original` does, with its tokenizer."""
    directory = root / cls
    shape = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2}
    shape |= {"num_attention_heads": 4, "intermediate_size": 37, "max_position_embeddings": 64}
    torch.manual_seed(11)
    model = getattr(transformers, cls)(
        transformers.BertConfig(**shape, num_labels=labels, **config)
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "word_embeddings" not in name:  # the MLM decoder stays the table
                param.add_(0.05 * torch.randn_like(param))
            if name.endswith(("query.weight", "key.weight")):
                param.mul_(6)
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copyfile(sources_vocab(root), directory / "vocab.txt")
    return directory, model


def sources_vocab(root: Path) -> Path:
    from tests.helpers.checkpoints import write_vocab

    path = root / "vocab.txt"
    if not path.is_file():
        write_vocab(path)
    return path


def export_head(
    model,
    out: Path,
    outputs: list[str],
    names: tuple[str, ...] | list[str] = ("input_ids", "attention_mask", "token_type_ids"),
) -> Path:
    """A plain `torch.onnx.export` of `model`: one graph file, nothing beside it."""
    names = list(names)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        model,
        tuple(torch.ones((2, 8), dtype=torch.long) for _ in names),
        str(out),
        input_names=names,
        output_names=outputs,
        dynamic_axes={n: {0: "batch", 1: "sequence"} for n in names},
        opset_version=17,
        dynamo=False,
    )
    return out


def ours_against_theirs(directory: Path, model, out: Path, field: str) -> float:
    """The imported checkpoint run by our model against the original transformers model."""
    from bertserve.export.onnx_import import _ours
    from bertserve.model.checkpoint import load_model

    inputs = feeds(BertTokenizer.load(directory), ["input_ids", "attention_mask", "token_type_ids"])
    with torch.no_grad():
        truth = getattr(model(**{k: torch.from_numpy(v) for k, v in inputs.items()}), field)
    ours = _ours(load_model(out).eval(), inputs)[1].reshape(truth.shape)
    return float(np.abs(ours - truth.numpy()).max() / np.abs(truth.numpy()).max())


@pytest.mark.parametrize("cls", list(HEAD_CASES))
@pytest.mark.parametrize("precision", ["fp32", "int8-per-channel"])
def test_every_head_imports(cls, precision, tmp_path):
    """QA, MLM (its decoder the word table again, quantised apart in int8) and token
    classification heads read back as the original model, from fp32 and per-channel int8."""
    outputs, field = HEAD_CASES[cls]
    directory, model = bert(tmp_path, cls, labels=2 if "Question" in cls else 5)
    graph = export_head(model, tmp_path / "torch" / "model.onnx", outputs)
    if precision != "fp32":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(
            str(graph), str(tmp_path / "q.onnx"), weight_type=QuantType.QInt8, per_channel=True
        )
        graph = tmp_path / "q.onnx"
    report = checkpoint_from_onnx(graph, tmp_path / "ckpt", tokenizer=directory)
    assert report["architecture"] == cls and report["heads"] == 4
    bound = 1e-5 if precision == "fp32" else 0.05
    assert ours_against_theirs(directory, model, tmp_path / "ckpt", field) <= bound


def test_a_bare_encoder_without_its_pooler_imports_for_embeddings(tmp_path):
    """Optimum's feature-extraction export of a BertModel keeps no pooler (its output is the
    last hidden state): it imports, the pooler left at init and said so, and an embed bundle
    of it answers as the original's mean-pooled hidden states."""
    from optimum.exporters.onnx import main_export

    directory, model = bert(tmp_path, "BertModel")
    transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(
        directory
    )
    main_export(str(directory), output=str(tmp_path / "opt"), task="feature-extraction")
    report = checkpoint_from_onnx(tmp_path / "opt", tmp_path / "ckpt")
    assert report["architecture"] == "BertModel"
    assert report["initialised"] == ["bert.pooler.dense.bias", "bert.pooler.dense.weight"]
    spec = build_bundle(tmp_path / "ckpt", ["embed"], tmp_path / "bundle")
    inputs = feeds(BertTokenizer.load(directory), ["input_ids", "attention_mask", "token_type_ids"])
    with torch.no_grad():
        hidden = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).last_hidden_state
    mask = torch.from_numpy(inputs["attention_mask"])[..., None].float()
    mean = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
    mean /= np.linalg.norm(mean, axis=-1, keepdims=True)
    pooled = run(tmp_path / "bundle" / spec.model_file, inputs)  # normalised when served
    pooled /= np.linalg.norm(pooled, axis=-1, keepdims=True)
    assert np.abs(pooled - mean).max() < 1e-5


def test_graphs_it_does_not_read_are_refused_by_name(sources, tmp_path):
    """fp16 and static (QDQ) graphs, an activation our encoder does not run, and an --out that
    is not the import's own (or holds the graph) are refused in one line, nothing deleted."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
    from onnxruntime.transformers.float16 import convert_float_to_float16

    made = sources["bert"]
    plain, tok = made["torch-fp32"], made["checkpoint"]
    half = convert_float_to_float16(onnx.load(str(plain)), keep_io_types=True)
    onnx.save(half, str(tmp_path / "half.onnx"))
    with pytest.raises(RecoverError, match="an fp16 graph"):
        checkpoint_from_onnx(tmp_path / "half.onnx", tmp_path / "a", tokenizer=tok)
    # what Optimum writes for sentence-transformers' library: the pooled vector as an output
    pooled = onnx.load(str(plain))
    pooled.graph.node.append(
        onnx.helper.make_node("Identity", [pooled.graph.output[0].name], ["sentence_embedding"])
    )
    pooled.graph.output.append(onnx.helper.make_tensor_value_info("sentence_embedding", 1, None))
    onnx.save(pooled, str(tmp_path / "st.onnx"))
    with pytest.raises(RecoverError, match="--library-name transformers"):
        checkpoint_from_onnx(tmp_path / "st.onnx", tmp_path / "a", tokenizer=tok)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = [
                feeds(BertTokenizer.load(tok), ["input_ids", "attention_mask", "token_type_ids"])
            ]

        def get_next(self):
            return self.left.pop() if self.left else None

    quantize_static(str(plain), str(tmp_path / "qdq.onnx"), Reader(), quant_format=QuantFormat.QDQ)
    with pytest.raises(RecoverError, match="static \\(QDQ\\)"):
        checkpoint_from_onnx(tmp_path / "qdq.onnx", tmp_path / "b", tokenizer=tok)

    directory, model = bert(tmp_path, "BertForSequenceClassification", labels=1, hidden_act="relu")
    relu = export_head(model, tmp_path / "relu" / "model.onnx", ["logits"])
    with pytest.raises(RecoverError, match="computes Relu"):
        checkpoint_from_onnx(relu, tmp_path / "c", tokenizer=directory)

    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    with pytest.raises(RecoverError, match="not an earlier import"):
        checkpoint_from_onnx(plain, keep, tokenizer=tok)
    assert (keep / "notes.txt").read_text() == "mine"
    with pytest.raises(RecoverError, match="holds the graph"):
        checkpoint_from_onnx(plain, plain.parent, tokenizer=tok)
    assert plain.is_file()
    checkpoint_from_onnx(plain, tmp_path / "again", tokenizer=tok)  # an earlier import: replaced
    checkpoint_from_onnx(plain, tmp_path / "again", tokenizer=tok)
    assert not (tmp_path / "again.tmp").exists()
