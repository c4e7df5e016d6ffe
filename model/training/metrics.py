"""Task metrics as their benchmarks define them: SQuAD v1.1's official answer normalisation, EM
and token F1 against the best reference; CoNLL entity-level micro F1 with exact spans (seqeval,
conlleval-compatible); accuracy."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse white space (the
    official SQuAD v1.1 evaluation script's normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def token_f1(prediction: str, truth: str) -> float:
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = Counter(predicted) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(
    predictions: Sequence[str], references: Sequence[Sequence[str]]
) -> dict[str, float]:
    """EM and F1 in percent, each prediction scored against its best-matching reference."""
    em = sum(
        max(exact_match(p, t) for t in refs)
        for p, refs in zip(predictions, references, strict=True)
    )
    f1 = sum(
        max(token_f1(p, t) for t in refs) for p, refs in zip(predictions, references, strict=True)
    )
    n = max(1, len(predictions))
    return {"exact_match": 100 * em / n, "f1": 100 * f1 / n, "examples": len(predictions)}


def entity_f1(
    gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Entity-level micro precision / recall / F1 in percent, exact spans (conlleval rules)."""
    from seqeval.metrics import f1_score, precision_score, recall_score

    gold_l, pred_l = [list(s) for s in gold], [list(s) for s in predicted]
    return {
        "precision": 100 * precision_score(gold_l, pred_l),
        "recall": 100 * recall_score(gold_l, pred_l),
        "f1": 100 * f1_score(gold_l, pred_l),
        "sentences": len(gold_l),
    }


def span_f1(gold: Sequence[set[tuple]], predicted: Sequence[set[tuple]]) -> dict[str, float]:
    """Micro precision / recall / F1 in percent over exact (type, start, end) spans, sentence by
    sentence: what a user of /ner receives, character offsets, judged as it is."""
    tp = sum(len(g & p) for g, p in zip(gold, predicted, strict=True))
    n_gold, n_pred = sum(map(len, gold)), sum(map(len, predicted))
    precision, recall = tp / max(1, n_pred), tp / max(1, n_gold)
    f1 = 2 * precision * recall / (precision + recall) if tp else 0.0
    return {"precision": 100 * precision, "recall": 100 * recall, "f1": 100 * f1}


def accuracy(gold: Sequence[object], predicted: Sequence[object]) -> float:
    return 100 * sum(g == p for g, p in zip(gold, predicted, strict=True)) / max(1, len(gold))
