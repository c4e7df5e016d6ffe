"""The model table: bundles of the repository (the bundle directory) loaded into `Model`s (its
spec, task context, engine or engine-process handle, and batcher), checked against the task
registry, with the default model of each task. At start every bundle is loaded (static model
control) or the named ones (explicit); service.control loads and unloads one at a time."""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bertserve.runtime.batching import Activity, Batcher
from bertserve.runtime.bundle import (
    BUNDLE_FILE,
    BundleError,
    BundleSpec,
    bundle_dirs,
    check_model_file,
    load_bundle_spec,
)
from bertserve.runtime.capabilities import graph_tasks
from bertserve.runtime.engine import CPU_PROVIDERS, Engine, vocab_call_tokens
from bertserve.runtime.tasks import READS
from bertserve.runtime.tasks.common import TaskContext
from bertserve.service.metrics import Metrics
from bertserve.service.process.engine_client import RemoteBackend
from bertserve.service.process.memory import rss_mb
from bertserve.service.settings import Settings

log = logging.getLogger("bertserve.models")


def check_serves(directory: Path, spec: BundleSpec) -> None:
    """Every task the bundle declares is one an endpoint serves, with the outputs it reads (a
    multivector bundle's "rerank" reads its vectors: runtime/capabilities.py graph_tasks)."""
    for task in graph_tasks(spec.tasks):
        reads = READS.get(task)
        if reads is None:
            raise BundleError(
                f"{directory / BUNDLE_FILE}: task {task!r} is served by no endpoint; "
                f"known: {sorted(READS)}"
            )
        missing = sorted(reads - set(spec.outputs))
        if missing:
            raise BundleError(f"{directory / BUNDLE_FILE}: {task} needs the outputs {missing}")


@dataclass(eq=False)
class Model:
    name: str
    spec: BundleSpec
    ctx: TaskContext
    engine: Engine | RemoteBackend
    batcher: Batcher
    version: str = ""  # bundle_version: its bundle.json's and tokenizer.json's sha256
    users: int = 0  # requests picked for it and not yet answered (service.handler)
    used: float = 0.0  # when a request last picked it (time.monotonic; service.control's LRU)
    memory_mb: float = 0.0  # what loading it added to the process's resident memory, at least
    # its model file's size (service.control's budget)


# A bundle's name as a repository directory and a URL segment: no path, no dot files.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def repository(root: Path) -> dict[str, Path]:
    """The bundles of the repository by name: each subdirectory holding a bundle.json."""
    return {d.name: d for d in bundle_dirs(root)}


def bundle_version(directory: Path) -> str:
    """A bundle's version: the sha256 of its bundle.json (which holds its model file's sha256)
    and its tokenizer.json, one after the other."""
    digest = hashlib.sha256((directory / BUNDLE_FILE).read_bytes())
    tokenizer = directory / "tokenizer.json"
    if tokenizer.is_file():
        digest.update(tokenizer.read_bytes())
    return digest.hexdigest()


def load_model(
    settings: Settings,
    metrics: Metrics,
    directory: Path,
    activity: Activity,
    engine_address: str = "",
) -> Model:
    """One bundle, checked and loaded: its ONNX Runtime sessions (or its handle on the engine
    process), tokenizer and batcher (not started). A bad bundle is a BundleError naming it."""
    version = bundle_version(directory)
    before = rss_mb()
    spec = load_bundle_spec(directory)
    check_model_file(directory, spec)
    check_serves(directory, spec)
    engine: Engine | RemoteBackend
    if engine_address:  # the engine process runs it (service.process.engine_server)
        engine = RemoteBackend(engine_address, spec)
    else:
        engine = Engine(directory, spec, settings.engine_options())
    max_rows = min(settings.max_request_rows, settings.max_queue_rows)
    ctx = TaskContext.load(
        directory,
        spec,
        settings.max_text_chars,
        max_rows,
        settings.auto_truncate or settings.long_input == "truncate",
        settings.long_input,
        settings.max_response_bytes,
    )
    batcher = Batcher(
        spec.name,
        engine,
        settings,
        metrics,
        spec.output_axes,
        spec.tokenizer.pad_id,
        1 if "mask_positions" in spec.inputs else None,  # until probe_slots says 0
        activity,
        call_tokens(spec, engine.provider),
    )
    model_info(metrics, spec, engine.provider).set(1)
    log.info(
        "loaded %s (%s, %s) on %s",
        spec.name,
        ",".join(spec.tasks),
        spec.precision,
        engine.provider,
    )
    model = Model(spec.name, spec, ctx, engine, batcher, version)
    model.memory_mb = floor_mb(directory, spec, rss_mb() - before)
    return model


def call_tokens(spec: BundleSpec, provider: str) -> int | None:
    """The padded tokens a call of this model may hold, where less than max_batch_tokens: a
    graph with a vocabulary-wide head on a CPU (runtime.engine.VOCAB_CALL_BYTES); None
    elsewhere (a GPU's memory is its own), and for a head in a graph of its own, whose calls the
    engine bounds while the encoder's stay whole."""
    if spec.sparse is None or "sparse_embeddings" in spec.heads or provider not in CPU_PROVIDERS:
        return None
    return vocab_call_tokens(spec)


def model_info(metrics: Metrics, spec: BundleSpec, provider: str) -> Any:
    """The model's series of bertserve_model_info: 1 while it is loaded, 0 once unloaded."""
    tasks = ",".join(spec.tasks)
    return metrics.model_info.labels(
        spec.name, tasks, spec.precision, provider, str(spec.max_seq_len)
    )


def floor_mb(directory: Path, spec: BundleSpec, measured: float) -> float:
    """A model's memory: what its load was measured to add, at least its model file's size
    (a measurement taken while other threads free memory can come out low)."""
    return max(measured, sum((directory / name).stat().st_size for name in spec.files) / 2**20)


def load_models(
    settings: Settings,
    metrics: Metrics,
    activity: Activity | None = None,
    engine_address: str = "",
    names: tuple[str, ...] | None = None,
) -> dict[str, Model]:
    """The bundles under settings.bundles, by name: every one, or `names` (in that order); a
    bad one is a BundleError naming it. `activity`: the requests in flight on the cores this
    process shares (one for all its batchers)."""
    activity = activity or Activity()
    models: dict[str, Model] = {}
    root = settings.bundles
    found = repository(root)
    if names is None and not found:
        raise BundleError(f"{root}: no bundles (no */{BUNDLE_FILE})")
    missing = [n for n in names or () if n not in found]
    if missing:
        raise BundleError(
            f"{root}: load_at_start names {missing}, which the repository does not hold; it "
            f"holds {sorted(found)}"
        )
    for name in found if names is None else names:
        directory = found[name]
        model = load_model(settings, metrics, directory, activity, engine_address)
        if model.name in models:
            raise BundleError(
                f"{directory / BUNDLE_FILE}: name {model.name!r} is taken by another bundle"
            )
        models[model.name] = model
    if settings.model_control == "static":
        for task, serving_names in serving(models).items():
            marked = [n for n in serving_names if models[n].spec.default]
            if len(marked) > 1:
                raise BundleError(f"{root}: bundles {marked} all say default for {task}; keep one")
    return models


def serving(models: dict[str, Model]) -> dict[str, list[str]]:
    """Task -> the names of the models serving it, the default first: of those whose bundle
    says `default`, the one loaded first; else the one loaded first (a replaced model keeps its
    place)."""
    out: dict[str, list[str]] = {}
    for model in sorted(models.values(), key=lambda m: not m.spec.default):
        for task in model.spec.tasks:
            out.setdefault(task, []).append(model.name)
    return out


def defaults(models: dict[str, Model]) -> dict[str, Model]:
    """Task -> the model a request without ?model= gets (the one marked default, else the only)."""
    return {task: models[names[0]] for task, names in serving(models).items()}
