"""What every task shares: the bundle's tokenizer, text validation, rows, and softmax."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from service.batching import Row
from service.bundle import BundleSpec
from service.errors import InvalidInput, TooLarge


@dataclass
class TaskContext:
    """A bundle as the tasks see it: its spec and two tokenizers (one plain, one that windows;
    `tokenizers` keeps truncation settings on the object, and all tokenising happens on the
    event loop, so each instance is only ever configured by one caller at a time)."""

    spec: BundleSpec
    tokenizer: Tokenizer
    windowing: Tokenizer
    max_text_chars: int

    @classmethod
    def load(cls, directory: Path, spec: BundleSpec, max_text_chars: int) -> TaskContext:
        path = str(directory / spec.tokenizer.file)
        plain, windowing = Tokenizer.from_file(path), Tokenizer.from_file(path)
        plain.no_truncation()
        plain.no_padding()
        windowing.no_padding()
        return cls(spec, plain, windowing, max_text_chars)

    @property
    def max_len(self) -> int:
        return self.spec.max_seq_len

    def check_text(self, text: str, what: str = "input") -> str:
        if not text.strip():
            raise InvalidInput(f"{what} is empty")
        if len(text) > self.max_text_chars:
            raise TooLarge(
                f"{what} has {len(text):,} characters; the limit is {self.max_text_chars:,}"
            )
        return text

    def encode(self, text: str, pair: str | None = None, truncate: bool = False) -> Encoding:
        """Encode without cutting; an encoding longer than the model takes is a 413 unless the
        request asked to truncate."""
        if truncate:
            self.windowing.enable_truncation(self.max_len, strategy="longest_first")
            return self.windowing.encode(text, pair)
        enc = self.tokenizer.encode(text, pair)
        if len(enc.ids) > self.max_len:
            raise TooLarge(
                f"input is {len(enc.ids)} tokens; the model takes {self.max_len}. "
                'Shorten it or send "parameters": {"truncation": true}'
            )
        return enc


def row(enc: Encoding, mask_positions: np.ndarray | None = None) -> Row:
    return Row(
        np.asarray(enc.ids, dtype=np.int64),
        np.asarray(enc.type_ids, dtype=np.int64),
        mask_positions,
    )


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = np.exp(x - x.max(axis=axis, keepdims=True))
    return shifted / shifted.sum(axis=axis, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
