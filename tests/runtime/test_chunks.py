"""Chunking long inputs (runtime/tasks/chunks.py): the chunks cover the text, hold at most their
pieces, overlap by at most what was asked, end at white space where the text has any, and their
character offsets slice out the text their pieces came from."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bertserve.runtime.tasks.chunks import (
    Chunk,
    boundaries,
    chunks_of,
    id_chunks,
    late_windows,
    plan,
    window_for,
)

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "bundles" / "minilm-embed" / "tokenizer.json"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_truncation()
    tok.no_padding()
    return tok


MIXED = (
    "Café résumé naïve façade   über\tcoöperate. "
    "Emoji 😀🎉 between words, 日本語のテキストは空白なしで続く。 "
    "Whitespace   runs\n\n\nand\u00a0no-break spaces; "
    "a longword-with-hyphens and (parentheses) [brackets] 12,345.67 numbers. "
)


def check(text: str, chunks: list[Chunk], tok: Tokenizer, size: int, overlap: int) -> None:
    enc = tok.encode(text, add_special_tokens=False)
    n = len(enc)
    assert chunks[0].first == 0 and chunks[-1].last == n
    for a, b in itertools.pairwise(chunks):
        assert b.first > a.first, "chunks advance"
        assert b.first <= a.last, "no piece is left out"
        assert a.last - b.first <= overlap, "overlap at most as asked"
    for c in chunks:
        assert 0 < c.tokens <= size
        # The slice is the text the chunk's pieces came from: it tokenises to those pieces.
        piece = text[c.start : c.end]
        assert tok.encode(piece, add_special_tokens=False).ids == enc.ids[c.first : c.last]
        assert piece == piece.strip()


@pytest.mark.parametrize("size,overlap", [(16, 0), (16, 4), (32, 8), (128, 16)])
def test_chunks_of_mixed_text_slice_back_to_their_pieces(tok, size, overlap):
    text = MIXED * 12
    enc = tok.encode(text, add_special_tokens=False)
    chunks = chunks_of(text, enc, size, overlap)
    check(text, chunks, tok, size, overlap)
    assert len(chunks) > 1


def test_chunks_end_at_white_space_where_the_text_has_it(tok):
    text = " ".join(f"word{i % 7}ing" for i in range(400))  # every word several pieces
    enc = tok.encode(text, add_special_tokens=False)
    chunks = chunks_of(text, enc, 32, 8)
    check(text, chunks, tok, 32, 8)
    for c in chunks:
        assert c.start == 0 or text[c.start - 1] == " "
        assert c.end == len(text) or text[c.end] == " "


def test_offsets_count_code_points(tok):
    text = "😀 " * 5 + "alpha beta gamma " * 40  # an emoji is one code point, four UTF-8 bytes
    enc = tok.encode(text, add_special_tokens=False)
    chunks = chunks_of(text, enc, 16, 0)
    check(text, chunks, tok, 16, 0)
    assert chunks[0].start == 0
    assert text[chunks[1].start : chunks[1].start + 5] in {"alpha", "beta ", "gamma"}


def test_a_run_without_white_space_is_cut_between_words_of_the_tokenizer(tok):
    text = "日本語" * 200  # CJK: a word a character, no white space anywhere
    enc = tok.encode(text, add_special_tokens=False)
    chunks = chunks_of(text, enc, 50, 5)
    check(text, chunks, tok, 50, 5)
    assert all(c.tokens == 50 for c in chunks[:-1])


def test_a_word_longer_than_a_chunk_is_cut_between_its_pieces(tok):
    text = "supercalifragilisticexpialidocious" * 2 + " end"  # 68 characters: under 100
    enc = tok.encode(text, add_special_tokens=False)
    chunks = chunks_of(text, enc, 8, 2)
    assert chunks[0].tokens == 8 and chunks[-1].last == len(enc)


def test_a_text_that_fits_is_one_chunk_of_all_of_it(tok):
    text = "  A short text.  "
    enc = tok.encode(text, add_special_tokens=False)
    assert chunks_of(text, enc, 128, 16) == [Chunk(0, len(enc), 2, len(text) - 2)]


def test_plan_prefers_white_space_then_words_and_always_advances():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 400)
        ranks = [rng.choice((0, 0, 1, 2)) for _ in range(n + 1)]
        ranks[0] = ranks[n] = 2
        size = rng.randint(1, 64)
        overlap = rng.randint(0, size - 1)
        spans = plan(ranks, size, overlap)
        assert spans[0][0] == 0 and spans[-1][1] == n
        for (a, b), (c, _d) in itertools.pairwise(spans):
            assert c > a and c <= b and b - c <= overlap
        for a, b in spans:
            assert 0 < b - a <= size or n == 0
        for a, b in spans[:-1]:  # the latest best boundary of the second half
            window = range(a + max(1, size // 2), a + size + 1)
            assert ranks[b] == max(ranks[x] for x in window)


def test_id_chunks_cover_the_ids():
    chunks = id_chunks(1000, 254, 32)
    assert chunks[0].first == 0 and chunks[-1].last == 1000
    assert all(c.tokens <= 254 for c in chunks)


@pytest.mark.parametrize("n,room,longest", [(1000, 254, 128), (5000, 254, 64), (300, 254, 254)])
def test_every_chunk_lies_whole_in_a_late_window(n, room, longest):
    starts = late_windows(n, room, longest)
    assert starts[0] == 0 and starts[-1] + room == n
    rng = random.Random(1)
    for _ in range(500):
        size = rng.randint(1, longest)
        first = rng.randint(0, n - size)
        chunk = Chunk(first, first + size, 0, 0)
        s = starts[window_for(chunk, starts, room)]
        assert s <= chunk.first and chunk.last <= s + room


def test_the_late_window_chosen_gives_the_chunk_the_most_context():
    starts = late_windows(1000, 200, 50)  # windows every 150 pieces
    chunk = Chunk(160, 200, 0, 0)  # in windows 0 (ends 200) and 1 (150..350)
    assert starts[window_for(chunk, starts, 200)] == 150


def test_boundaries_rank_white_space_over_punctuation_over_inside_a_word(tok):
    text = "alpha, betagammadeltaepsilon"
    enc = tok.encode(text, add_special_tokens=False)
    ranks = boundaries(text, enc)
    tokens = enc.tokens
    assert tokens[:2] == ["alpha", ","]
    assert ranks[1] == 1  # alpha|,
    assert ranks[2] == 2  # ,| beta...
    assert 0 in ranks[3:-1]  # inside the long word


def test_late_windows_centre_on_each_chunk_where_a_grid_would_be_denser():
    """Chunks as long as the window leave a grid no room to step: one window a chunk, each
    centred on its chunk, instead of one a piece."""
    n, room = 1000, 254
    chunks = [Chunk(a, min(a + 254, n), 0, 0) for a in range(0, n, 222)]
    starts = late_windows(n, room, 254, chunks)
    assert len(starts) <= len(chunks)
    for chunk in chunks:
        s = starts[window_for(chunk, starts, room)]
        assert s <= chunk.first and chunk.last <= s + room
    small = [Chunk(a, a + 32, 0, 0) for a in range(0, 960, 32)]
    assert late_windows(n, room, 32, small) == late_windows(n, room, 32)  # the grid: fewer
