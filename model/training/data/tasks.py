"""Readers of the fine-tuning data sets, in their published formats, and the features training
needs: SST-2 and TREC (classification), CoNLL-2003 (NER, IOB1 -> BIO), SQuAD v1.1 (QA windows).

Every reader takes the data set's directory as an argument; none has a default location.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

from bertserve.model.tokenizer import BertTokenizer, Encoding
from bertserve.runtime.encoding import CASE_UNKNOWN, case_type, case_unknown
from bertserve.runtime.tasks.ner import marks_continuations, piece_is_subword

IGNORE = -100


# --- classification ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextExample:
    text: str
    label: str


SST2_LABELS = ("negative", "positive")  # GLUE's 0 / 1


def read_sst2(directory: Path, split: str) -> list[TextExample]:
    """GLUE SST-2 `train.tsv` / `dev.tsv`: `sentence<TAB>label` with a header."""
    with open(directory / f"{split}.tsv", encoding="utf-8", newline="") as f:
        rows = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        return [TextExample(r["sentence"].strip(), SST2_LABELS[int(r["label"])]) for r in rows]


def read_trec(directory: Path, split: str) -> list[TextExample]:
    """UIUC/TREC question classification: `COARSE:fine question ...` a line; coarse labels.
    Split `dev` is the published test set (TREC has no separate dev set)."""
    name = {"train": "train.txt", "dev": "test.txt", "test": "test.txt"}[split]
    out = []
    for line in (directory / name).read_text(encoding="latin-1").splitlines():
        if line.strip():
            label, text = line.split(" ", 1)
            out.append(TextExample(text.strip(), label.split(":")[0]))
    return out


# --- NER ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaggedSentence:
    words: list[str]
    tags: list[str]  # BIO


def iob1_to_bio(tags: list[str]) -> list[str]:
    """IOB1 (I- unless two entities of a type touch, then B-) -> BIO (B- starts every entity)."""
    out: list[str] = []
    for i, tag in enumerate(tags):
        if tag.startswith("I-"):
            previous = out[i - 1] if i else "O"
            if previous == "O" or previous[2:] != tag[2:]:
                tag = "B-" + tag[2:]
        out.append(tag)
    return out


def read_conll(directory: Path, split: str) -> list[TaggedSentence]:
    """CoNLL-2003 `eng.train` / `eng.testa` (dev) / `eng.testb` (test): word POS chunk NER."""
    name = {"train": "eng.train", "dev": "eng.testa", "test": "eng.testb"}[split]
    sentences: list[TaggedSentence] = []
    words: list[str] = []
    tags: list[str] = []
    for line in [*(directory / name).read_text(encoding="utf-8").splitlines(), ""]:
        if not line.strip() or line.startswith("-DOCSTART-"):
            if words:
                sentences.append(TaggedSentence(words, iob1_to_bio(tags)))
            words, tags = [], []
            continue
        parts = line.split()
        words.append(parts[0])
        tags.append(parts[-1])
    return sentences


def read_conll_documents(directory: Path, split: str) -> list[list[str]]:
    """CoNLL-2003's documents (Reuters news stories, split at -DOCSTART-), each a list of its
    sentences, words joined by single spaces: running news text for /fill-mask and /nsp."""
    name = {"train": "eng.train", "dev": "eng.testa", "test": "eng.testb"}[split]
    documents: list[list[str]] = []
    words: list[str] = []
    for line in [*(directory / name).read_text(encoding="utf-8").splitlines(), ""]:
        if line.startswith("-DOCSTART-"):
            documents.append([])
        elif not line.strip():
            if words and documents:
                documents[-1].append(" ".join(words))
            words = []
        else:
            words.append(line.split()[0])
    return [d for d in documents if d]


CONLL_LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")


def align_labels(
    tokenizer: BertTokenizer,
    words: list[str],
    tags: list[str],
    label2id: dict[str, int],
    max_len: int,
    case_types: int = 0,
) -> tuple[list[int], list[int], list[int]]:
    """Word pieces of a pre-split sentence and their labels, given where /ner's aggregation
    reads them: every piece it takes for a word's start (runtime.tasks.ner.piece_is_subword)
    carries a label, so "AL-AIN" (al, -, ain) is B-LOC, I-LOC, I-LOC rather than B-LOC and two
    pieces never trained. A word's continuations ("##ain"), [CLS] and [SEP] get -100. Returns
    (ids, labels, segment ids): zeros, or with `case_types` (a scheme, runtime/tasks/ner.py) each
    piece's letter case as the service computes it."""
    enc = tokenizer.tokenizer.encode(words, is_pretokenized=True)
    word_aware = marks_continuations(tokenizer.tokenizer)
    unknown = case_unknown(case_types, "".join(words))
    ids, labels, types, previous = [], [], [], None
    for token_id, token, word, (start, end) in zip(
        enc.ids, enc.tokens, enc.word_ids, enc.offsets, strict=True
    ):
        ids.append(token_id)
        if word is None:
            labels.append(IGNORE)
        elif word != previous:
            labels.append(label2id[tags[word]])
        elif piece_is_subword(
            word_aware, token, words[word], start, end, token_id == tokenizer.unk_id
        ):
            labels.append(IGNORE)
        else:  # a later word of the same CoNLL word, as the aggregation splits it at punctuation
            labels.append(label2id[inside(tags[word])])
        if not case_types or word is None:
            types.append(0)
        else:  # a pre-split word's pieces have offsets into the word
            types.append(CASE_UNKNOWN if unknown else case_type(words[word][start:end]))
        previous = word
    if len(ids) > max_len:  # keep [SEP] at the end
        ids, labels = [*ids[: max_len - 1], ids[-1]], [*labels[: max_len - 1], IGNORE]
        types = [*types[: max_len - 1], 0]
    return ids, labels, types


def inside(tag: str) -> str:
    """The tag of an entity's later words: B-X -> I-X; I-X and O stay."""
    return "I-" + tag[2:] if tag.startswith("B-") else tag


# --- QA -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QaExample:
    id: str
    question: str
    context: str
    answers: list[str]
    answer_start: int  # of answers[0] in context


def read_squad(directory: Path, split: str, drop_ids: set[str] | None = None) -> list[QaExample]:
    name = {"train": "train-v1.1.json", "dev": "dev-v1.1.json"}[split]
    data = json.loads((directory / name).read_text(encoding="utf-8"))
    out = []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                if drop_ids and qa["id"] in drop_ids:
                    continue
                answers = qa["answers"]
                out.append(
                    QaExample(
                        qa["id"],
                        qa["question"],
                        paragraph["context"],
                        [a["text"] for a in answers],
                        answers[0]["answer_start"],
                    )
                )
    return out


def ambiguous_ids(directory: Path, split: str) -> set[str]:
    path = directory / f"{split}-ambiguous-answer-start-ids.txt"
    return set(path.read_text().split()) if path.is_file() else set()


@dataclass(frozen=True)
class QaFeature:
    input_ids: list[int]
    token_type_ids: list[int]
    start: int  # token index of the answer's first piece in this window; 0 ([CLS]) if absent
    end: int


def qa_features(
    tokenizer: BertTokenizer, example: QaExample, max_len: int, doc_stride: int
) -> list[QaFeature]:
    """Windows of `[CLS] question [SEP] context [SEP]` over a long context (the tokenizer's
    overflow, `doc_stride` tokens of overlap, as the service windows /qa), with the answer's
    token span in each window, or [CLS] where the answer is not wholly inside."""
    tok = tokenizer.tokenizer
    tok.enable_truncation(max_len, stride=doc_stride, strategy="only_second")
    try:
        first = tok.encode(example.question, example.context)
    finally:
        tok.no_truncation()
    answer_start = example.answer_start
    answer_end = answer_start + len(example.answers[0])  # exclusive
    features = []
    for enc in [first, *first.overflowing]:
        start = end = 0
        context = [i for i, s in enumerate(enc.sequence_ids) if s == 1]
        if context:
            first_char = enc.offsets[context[0]][0]
            last_char = enc.offsets[context[-1]][1]
            if first_char <= answer_start and answer_end <= last_char:
                start = next(i for i in context if enc.offsets[i][1] > answer_start)
                end = next(i for i in reversed(context) if enc.offsets[i][0] < answer_end)
        features.append(QaFeature(enc.ids, enc.type_ids, start, end))
    return features


@dataclass(frozen=True)
class QaEncoding:
    encoding: Encoding  # [CLS] question [SEP] context [SEP], with offsets and tokens
    start: int  # the answer's token span
    end: int


def qa_single_window(
    tokenizer: BertTokenizer, example: QaExample, max_len: int
) -> QaEncoding | None:
    """The example as one window with its answer span, or None if the question and context do
    not fit `max_len` tokens (distillation compares whole contexts across two tokenisers)."""
    enc = tokenizer.encode(example.question, example.context)
    if len(enc.input_ids) > max_len:
        return None
    answer_start = example.answer_start
    answer_end = answer_start + len(example.answers[0])
    context = [i for i, s in enumerate(enc.sequence_ids) if s == 1]
    start = next((i for i in context if enc.offsets[i][1] > answer_start), None)
    end = next((i for i in reversed(context) if enc.offsets[i][0] < answer_end), None)
    if start is None or end is None or end < start:
        return None
    return QaEncoding(enc, start, end)


def subsample(items: list, fraction: float, seed: int) -> list:
    if fraction >= 1.0:
        return items
    rng = random.Random(seed)
    return rng.sample(items, max(1, int(len(items) * fraction)))
