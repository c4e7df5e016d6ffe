"""WordPiece tokenisation through the `tokenizers` library: train a vocabulary, save, load, encode.

The pipeline is BERT's: clean text, optional lower-casing with accent stripping, split on white
space and punctuation, WordPiece with `##` continuations, and the templates
`[CLS] A [SEP]` / `[CLS] A [SEP] B [SEP]` with segment ids 0 and 1. Every token carries its
character span in the original text (specials get (0, 0)), which NER and QA need to map
predictions back to the user's string. Saved as one `tokenizer.json`, the file a bundle ships and
the service loads with nothing but `tokenizers`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
TOKENIZER_NAME = "tokenizer.json"
VOCAB_NAME = "vocab.txt"
TRUNCATION_STRATEGIES = ("longest_first", "only_first", "only_second")


@dataclass(frozen=True)
class Encoding:
    """One encoded sequence (or pair), unpadded."""

    input_ids: list[int]
    token_type_ids: list[int]
    offsets: list[tuple[int, int]]  # character span of each token in its own text; specials (0, 0)
    sequence_ids: list[int | None]  # 0 = first text, 1 = second, None = special token
    tokens: list[str]


def _pipeline(wordpiece: models.WordPiece, lowercase: bool) -> Tokenizer:
    tok = Tokenizer(wordpiece)
    # strip_accents=None follows lowercase, as BertTokenizerFast does.
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


def _add_templates(tok: Tokenizer) -> Tokenizer:
    cls_id, sep_id = tok.token_to_id(CLS), tok.token_to_id(SEP)
    if cls_id is None or sep_id is None:
        raise ValueError(f"the vocabulary lacks {CLS} or {SEP}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS}:0 $A:0 {SEP}:0",
        pair=f"{CLS}:0 $A:0 {SEP}:0 $B:1 {SEP}:1",
        special_tokens=[(CLS, cls_id), (SEP, sep_id)],
    )
    return tok


# The roles of the special tokens, and BERT's tokens for them. Another family's checkpoint names
# its own (RoBERTa: <pad> <unk> <s> </s> <mask>) in special_tokens_map.json or
# tokenizer_config.json beside its tokenizer.json.
ROLES = ("pad", "unk", "cls", "sep", "mask")
BERT_SPECIALS = dict(zip(ROLES, SPECIAL_TOKENS, strict=True))
SPECIALS_FILES = ("special_tokens_map.json", "tokenizer_config.json")


def read_specials(directory: Path) -> dict[str, str]:
    """The special tokens a Hugging Face tokenizer directory names, by role; BERT's for a role
    it does not name."""
    import json

    named: dict[str, str] = {}
    for name in SPECIALS_FILES:
        path = directory / name
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        for role in ROLES:
            value = data.get(f"{role}_token")
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and role not in named:
                named[role] = value
    return BERT_SPECIALS | named


class BertTokenizer:
    """A `tokenizers.Tokenizer` with its special tokens by role and a small, explicit API. The
    name is BERT's; the tokenizer may be any of `tokenizers`' (WordPiece, byte-level BPE,
    SentencePiece Unigram), with the special tokens its checkpoint names."""

    def __init__(
        self, tokenizer: Tokenizer, lowercase: bool, specials: dict[str, str] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.lowercase = lowercase
        self.specials = specials or dict(BERT_SPECIALS)
        ids = {role: tokenizer.token_to_id(t) for role, t in self.specials.items()}
        lacking = [self.specials[r] for r, i in ids.items() if i is None]
        if lacking:
            raise ValueError(f"the vocabulary lacks the special tokens {lacking}")
        self.special_ids: dict[str, int] = {
            self.specials[r]: int(i) for r, i in ids.items() if i is not None
        }
        by_role = {r: int(i) for r, i in ids.items() if i is not None}
        self.pad_id, self.unk_id = by_role["pad"], by_role["unk"]
        self.cls_id, self.sep_id = by_role["cls"], by_role["sep"]
        self.mask_id = by_role["mask"]
        self.mask_token = self.specials["mask"]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def lower_casing(self) -> BertTokenizer:
        """This tokenizer with the text lower-cased before its own normalizer runs, as
        sentence-transformers' `do_lower_case` does (`str.lower` before tokenizing)."""
        raw = Tokenizer.from_str(self.tokenizer.to_str())
        steps = [normalizers.Lowercase()]
        if raw.normalizer is not None:
            steps.append(raw.normalizer)
        raw.normalizer = normalizers.Sequence(steps)
        return BertTokenizer(raw, True, self.specials)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        files: Iterable[str | Path] | None = None,
        vocab_size: int = 16384,
        lowercase: bool = False,
        texts: Iterable[str] | None = None,
        min_frequency: int = 2,
        show_progress: bool = False,
    ) -> BertTokenizer:
        """Learn a WordPiece vocabulary from text files (one passage a line) or an iterator."""
        tok = _pipeline(models.WordPiece(unk_token=UNK, max_input_chars_per_word=100), lowercase)
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),  # ids 0..4 in this order: [PAD] = 0
            continuing_subword_prefix="##",
            show_progress=show_progress,
        )
        if texts is not None:
            tok.train_from_iterator(texts, trainer=trainer)
        else:
            tok.train([str(f) for f in files or ()], trainer=trainer)
        return cls(_add_templates(tok), lowercase)

    @classmethod
    def from_vocab(cls, vocab_file: str | Path, lowercase: bool | None = None) -> BertTokenizer:
        """A Google/Hugging Face `vocab.txt`. Casing, if not given, is read off the vocabulary:
        a vocabulary with no upper-case word pieces was built lower-cased."""
        vocab_file = Path(vocab_file)
        if lowercase is None:
            words = vocab_file.read_text(encoding="utf-8").split("\n")
            lowercase = not any(w.lower() != w for w in words if not w.startswith("["))
        wordpiece = models.WordPiece.from_file(
            str(vocab_file), unk_token=UNK, max_input_chars_per_word=100
        )
        tok = _pipeline(wordpiece, lowercase)
        # As BertTokenizerFast: "[MASK]" typed in a text is the mask token, not "[", "mask", "]".
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
        )
        return cls(_add_templates(tok), lowercase)

    @classmethod
    def from_file(cls, path: str | Path, specials: dict[str, str] | None = None) -> BertTokenizer:
        """A tokenizer.json; its special tokens are `specials`, else those its directory names
        (special_tokens_map.json, tokenizer_config.json), else BERT's."""
        path = Path(path)
        tok = Tokenizer.from_file(str(path))
        # A published tokenizer.json may carry truncation and padding (all-MiniLM-L6-v2 ships
        # both at 128): every direct call of the underlying tokenizer would then pad short texts
        # with [PAD]s that no attention mask hides. Windows and lengths are ours to choose.
        tok.no_truncation()
        tok.no_padding()
        normalizer = tok.normalizer
        lowercase = bool(normalizer is not None and getattr(normalizer, "lowercase", False))
        return cls(tok, lowercase, specials or read_specials(path.parent))

    @classmethod
    def load(cls, directory: str | Path) -> BertTokenizer:
        """`tokenizer.json` if the directory has one, else `vocab.txt`."""
        directory = Path(directory)
        if (directory / TOKENIZER_NAME).is_file():
            return cls.from_file(directory / TOKENIZER_NAME)
        if (directory / VOCAB_NAME).is_file():
            return cls.from_vocab(directory / VOCAB_NAME)
        raise FileNotFoundError(
            f"{directory} has neither {TOKENIZER_NAME} nor {VOCAB_NAME}; for a BPE or "
            "SentencePiece checkpoint, write its tokenizer.json with transformers: "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
        )

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / TOKENIZER_NAME))
        vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda item: item[1])
        (directory / VOCAB_NAME).write_text("".join(f"{t}\n" for t, _ in vocab), encoding="utf-8")
        return directory / TOKENIZER_NAME

    # --- encoding -----------------------------------------------------------------------------

    def encode(
        self,
        text: str,
        pair: str | None = None,
        max_length: int | None = None,
        truncation: str = "longest_first",
        add_special_tokens: bool = True,
    ) -> Encoding:
        return self.encode_batch(
            [text], None if pair is None else [pair], max_length, truncation, add_special_tokens
        )[0]

    def encode_batch(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        max_length: int | None = None,
        truncation: str = "longest_first",
        add_special_tokens: bool = True,
    ) -> list[Encoding]:
        """Encode texts (and optional second segments). With `max_length`, sequences are cut to
        fit by `truncation`: `longest_first` trims the longer segment token by token,
        `only_first`/`only_second` trim one segment and fail if that is not enough."""
        if truncation not in TRUNCATION_STRATEGIES:
            raise ValueError(f"truncation {truncation!r} is not one of {TRUNCATION_STRATEGIES}")
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(pairs)} pairs")
        tok = self.tokenizer
        if max_length is None:
            tok.no_truncation()
        else:
            tok.enable_truncation(max_length, strategy=truncation)
        tok.no_padding()
        inputs = list(texts) if pairs is None else list(zip(texts, pairs, strict=True))
        try:
            encoded = tok.encode_batch(inputs, add_special_tokens=add_special_tokens)
        except Exception as exc:  # tokenizers raises a bare Exception when truncation cannot fit
            raise ValueError(f"cannot encode within max_length={max_length}: {exc}") from exc
        finally:
            tok.no_truncation()
        return [
            Encoding(
                input_ids=e.ids,
                token_type_ids=e.type_ids,
                offsets=[tuple(o) for o in e.offsets],
                sequence_ids=e.sequence_ids,
                tokens=e.tokens,
            )
            for e in encoded
        ]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.id_to_token(i) for i in ids]
