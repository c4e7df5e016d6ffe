"""The Wikipedia corpus (WikiExtractor `<doc>` blocks) as documents of sentence-split paragraphs.

Redirect stubs and near-empty articles are dropped by body length; section headings (short lines
ending in a period, like `History.`) are dropped, because they are not sentences and would make
false "next sentence" pairs. Sentences come from `sentencex` (Wikimedia's segmenter, offline,
about 25 MB/s here), not a regex. A fixed fraction of whole documents, chosen by a hash of the
page id so the split never depends on file order, is held out for evaluation.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sentencex import segment

_DOC_OPEN = re.compile(r'<doc id="(?P<id>[^"]+)"[^>]*title="(?P<title>[^"]*)"[^>]*>')
MIN_BODY_CHARS = 200  # SOURCE.md: 11,712 of 12,980 articles have more; the rest are stubs
MAX_HEADING_WORDS = 6


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    paragraphs: list[list[str]]  # each paragraph a list of sentences

    @property
    def sentences(self) -> list[str]:
        return [s for p in self.paragraphs for s in p]


def is_heading(line: str) -> bool:
    return line.endswith(".") and len(line.split()) <= MAX_HEADING_WORDS and line.count(".") == 1


def split_sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in segment("en", paragraph) if s.strip()]


def is_heldout(doc_id: str, fraction: float) -> bool:
    """Stable assignment of a document to the held-out set, independent of reading order."""
    bucket = int.from_bytes(hashlib.sha1(doc_id.encode()).digest()[:4], "big") / 2**32
    return bucket < fraction


def _parse(lines: list[str], doc_id: str, title: str) -> Document | None:
    body = lines[1:] if lines and lines[0].strip() == title.strip() else lines
    paragraphs = [line.strip() for line in body if line.strip() and not is_heading(line.strip())]
    if sum(len(p) for p in paragraphs) < MIN_BODY_CHARS:
        return None
    return Document(doc_id, title, [s for s in map(split_sentences, paragraphs) if s])


def read_documents(data_dir: str | Path, max_docs: int | None = None) -> Iterator[Document]:
    """Every kept document under `data_dir` (any depth), files in sorted path order."""
    files = sorted(
        p for p in Path(data_dir).rglob("*") if p.is_file() and not p.name.endswith(".md")
    )
    if not files:
        raise FileNotFoundError(f"no corpus files under {data_dir}")
    count = 0
    for path in files:
        doc_id = title = None
        lines: list[str] = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if doc_id is None:
                    match = _DOC_OPEN.match(line)
                    if match:
                        doc_id, title, lines = match["id"], match["title"], []
                elif line.startswith("</doc>"):
                    doc = _parse(lines, doc_id, title or "")
                    doc_id = None
                    if doc is not None:
                        yield doc
                        count += 1
                        if max_docs is not None and count >= max_docs:
                            return
                else:
                    lines.append(line.rstrip("\n"))
