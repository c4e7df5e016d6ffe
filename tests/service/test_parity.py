"""Every endpoint over real HTTP equals the transformers 4.57 pipeline of the same checkpoint:
same labels, tokens and spans, scores within 1e-4."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from tests.helpers.checkpoints import HF_CLASSES
from tests.helpers.server import live_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(bundle_dir):
    with live_server(bundles=bundle_dir) as live:
        yield live


def pipeline(task, checkpoints, arch):
    directory = checkpoints[arch]
    # The fill-mask pipeline wants a masked-LM model: the pre-training checkpoint's MLM head.
    model_class = transformers.BertForMaskedLM if task == "fill-mask" else HF_CLASSES[arch]
    return transformers.pipeline(
        task,
        model=model_class.from_pretrained(directory),
        tokenizer=transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt")),
        device="cpu",
    )


def assert_same(ours, theirs, path="result"):
    """Equal structure and values; floats within 1e-4."""
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs), f"{path}: keys {sorted(ours)} != {sorted(theirs)}"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), f"{path}: {ours} != {theirs}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(theirs, float):
        assert ours == pytest.approx(theirs, abs=1e-4), path
    else:
        assert ours == (theirs.item() if hasattr(theirs, "item") else theirs), path


def post(server, path, body):
    with server.client() as c:
        response = c.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def plain(x):
    """numpy scalars in transformers' output -> Python numbers."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [plain(v) for v in x]
    return x.item() if hasattr(x, "item") else x


FILL = ["the [MASK] was good .", "who was the first [MASK] of [MASK] ?", "paris is a [MASK] ."]


@pytest.mark.parametrize("params", [{}, {"top_k": 3}, {"targets": ["dog", "city", "paris", "zzz"]}])
def test_fill_mask(server, checkpoints, params):
    reference = pipeline("fill-mask", checkpoints, "BertForPreTraining")
    for text in FILL:
        assert_same(
            post(server, "/fill-mask", {"inputs": text, "parameters": params}),
            plain(reference(text, **params)),
        )


CLASSIFY = ["the film was good", "a dull movie , a bad year", "paris", "who was the king ?"]


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 1},
        {"top_k": None},
        {"top_k": 2, "function_to_apply": "sigmoid"},
        {"top_k": None, "function_to_apply": "none"},
    ],
)
def test_classify(server, checkpoints, params):
    reference = pipeline("text-classification", checkpoints, "BertForSequenceClassification")
    assert_same(
        post(server, "/classify", {"inputs": CLASSIFY, "parameters": params}),
        plain(reference(CLASSIFY, **params)),
    )
    assert_same(
        post(server, "/classify", {"inputs": CLASSIFY[0], "parameters": params}),
        plain(reference(CLASSIFY[0], **params)),
    )


NER = [
    "the king of france was born in paris .",
    "queen fox and the dog went to london",
    "paris , france , london and the river city",
    "whatwhere whenwho",
]


@pytest.mark.parametrize("strategy", ["none", "simple", "first", "average", "max"])
def test_ner(server, checkpoints, strategy):
    reference = pipeline("token-classification", checkpoints, "BertForTokenClassification")
    for ignore in (["O"], []):
        ours = post(
            server,
            "/ner",
            {
                "inputs": NER,
                "parameters": {"aggregation_strategy": strategy, "ignore_labels": ignore},
            },
        )
        theirs = plain(reference(NER, aggregation_strategy=strategy, ignore_labels=ignore))
        assert_same(ours, theirs)


CONTEXT = ("paris is the first city of france . the river of paris was good . " * 12).strip()


@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 1},
        {"top_k": 3, "max_answer_len": 4},
        {"top_k": 2, "handle_impossible_answer": True},
    ],
)
def test_qa_with_windows(server, checkpoints, params):
    reference = pipeline("question-answering", checkpoints, "BertForQuestionAnswering")
    fixed = {"max_seq_len": 64, "doc_stride": 16}
    for question, context in (
        ("what is paris ?", CONTEXT),
        ("who was born ?", "the king was born ."),
    ):
        ours = post(
            server,
            "/qa",
            {"inputs": {"question": question, "context": context}, "parameters": params | fixed},
        )
        theirs = plain(reference(question=question, context=context, **params, **fixed))
        assert_same(ours, theirs)


PAIRS = [
    ("the film was good .", "paris is a city ."),
    ("who was the first king of france ?", "the king was born ."),
    ("a dull movie", "a bad year"),
]


def test_nsp_mixed_with_fill_mask(server, checkpoints):
    """/nsp equals BertForPreTraining's next-sentence head (transformers has no NSP pipeline),
    alone and with /fill-mask requests sent at the same time, so that their rows may share
    batches (whether they did is the batcher's timing; tests/service/process/test_device.py pads the
    two kinds into one call directly): the /nsp rows send no mask slots once the warm-up probe
    allowed it, and both answers stay right."""
    directory = checkpoints["BertForPreTraining"]
    model = transformers.BertForPreTraining.from_pretrained(directory).eval()
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt"))
    with torch.no_grad():
        texts, pairs = [a for a, _ in PAIRS], [b for _, b in PAIRS]
        logits = model(**tokenizer(texts, pairs, padding=True, return_tensors="pt"))
    p_next = torch.softmax(logits.seq_relationship_logits.double(), -1)[:, 0].tolist()
    expected = [{"is_next": p >= 0.5, "score": p} for p in p_next]
    assert server.app.state.service.models["pretrained"].batcher.positions == 0

    body = {"inputs": [{"text": a, "text_pair": b} for a, b in PAIRS]}
    assert_same(post(server, "/nsp", body), expected)
    fill = plain(pipeline("fill-mask", checkpoints, "BertForPreTraining")(FILL[1]))
    with ThreadPoolExecutor(8) as pool:  # at once: the batcher mixes the two kinds of rows
        jobs = [
            pool.submit(post, server, "/nsp", body)
            if i % 2
            else pool.submit(post, server, "/fill-mask", {"inputs": FILL[1]})
            for i in range(24)
        ]
        for i, job in enumerate(jobs):
            assert_same(job.result(), expected if i % 2 else fill)
