"""Input-encoding schemes: what a bundle feeds its graph beside the word pieces. One today:
letter case as segment ids (bundle.json tokenizer.case_type_ids), computed here for serving,
evaluation and training alike, so a model is fed as it was trained."""

from __future__ import annotations

# Letter case as segment ids, for a model with an uncased vocabulary (bundle.json
# tokenizer.case_type_ids): its word pieces cannot tell "apple" from "Apple", the strongest cue for
# names in news text. Segment 1 (sentence B) keeps its meaning; a tagging input has one segment,
# so the other ids carry each piece's case, from its characters in the caller's text.
CASE_NONE, CASE_TITLE, CASE_UPPER, CASE_MIXED = 0, 2, 3, 4  # 1 is sentence B
CASE_UNKNOWN = 5  # scheme 2: a text with no capital at all (typed in lower case, or no letters)
# The schemes (the value of case_type_ids): 1 reads a text without capitals as lower-case words;
# 2 feeds every piece of such a text as CASE_UNKNOWN, so a tagger trained on both (case_dropout)
# keeps "this word has no capital" a clean cue in text that has capitals.
CASE_AS_WRITTEN, CASE_OR_UNKNOWN = 1, 2
CASE_SCHEMES = (CASE_AS_WRITTEN, CASE_OR_UNKNOWN)


def case_type_vocab(scheme: int) -> int:
    """The segment ids a model needs for a case scheme."""
    if scheme not in CASE_SCHEMES:
        raise ValueError(f"case_type_ids must be one of {CASE_SCHEMES} (or 0: off), got {scheme!r}")
    return CASE_UNKNOWN + 1 if scheme == CASE_OR_UNKNOWN else CASE_MIXED + 1


def case_type(piece: str) -> int:
    """A word piece's case as it was written: no capital (also digits, punctuation), Capitalised
    (a capital and no other: "Paris", "I"), UPPER ("BBC", two or more letters), or mIxed."""
    letters = [c for c in piece if c.isalpha()]
    if not any(c.isupper() for c in letters):
        return CASE_NONE
    if len(letters) > 1 and all(c.isupper() for c in letters):
        return CASE_UPPER
    if letters[0].isupper() and not any(c.isupper() for c in letters[1:]):
        return CASE_TITLE
    return CASE_MIXED


def case_unknown(scheme: int, text: str) -> bool:
    """Whether `text` says nothing about case under `scheme`: no capital anywhere in it."""
    return scheme == CASE_OR_UNKNOWN and not any(c.isupper() for c in text)


def case_type_ids(
    text: str, offsets: list[tuple[int, int]], scheme: int = CASE_AS_WRITTEN
) -> list[int]:
    if case_unknown(scheme, text):
        return [CASE_UNKNOWN] * len(offsets)
    return [case_type(text[start:end]) for start, end in offsets]
