"""The model table: every bundle under the bundle directory loaded into a `Model` (its spec,
task context, engine or engine-process handle, and batcher), checked against the task registry,
with the default model of each task."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from bertserve.runtime.batching import Activity, Batcher
from bertserve.runtime.bundle import (
    BUNDLE_FILE,
    BundleError,
    BundleSpec,
    bundle_dirs,
    check_model_file,
    load_bundle_spec,
)
from bertserve.runtime.engine import Engine
from bertserve.runtime.tasks import READS
from bertserve.runtime.tasks.common import TaskContext
from bertserve.service.metrics import Metrics
from bertserve.service.process.engine_client import RemoteBackend
from bertserve.service.settings import Settings

log = logging.getLogger("bertserve.models")


def check_serves(directory: Path, spec: BundleSpec) -> None:
    """Every task the bundle declares is one an endpoint serves, with the outputs it reads."""
    for task in spec.tasks:
        reads = READS.get(task)
        if reads is None:
            raise BundleError(
                f"{directory / BUNDLE_FILE}: task {task!r} is served by no endpoint; "
                f"known: {sorted(READS)}"
            )
        missing = sorted(reads - set(spec.outputs))
        if missing:
            raise BundleError(f"{directory / BUNDLE_FILE}: {task} needs the outputs {missing}")


@dataclass
class Model:
    name: str
    spec: BundleSpec
    ctx: TaskContext
    engine: Engine | RemoteBackend
    batcher: Batcher


def load_models(
    settings: Settings,
    metrics: Metrics,
    activity: Activity | None = None,
    engine_address: str = "",
) -> dict[str, Model]:
    """Every bundle under settings.bundles, by name; a bad one is a BundleError naming it.
    `activity`: the requests in flight on the cores this process shares (one for all its
    batchers)."""
    activity = activity or Activity()
    models: dict[str, Model] = {}
    root = settings.bundles
    dirs = bundle_dirs(root)
    if not dirs:
        raise BundleError(f"{root}: no bundles (no */{BUNDLE_FILE})")
    for directory in dirs:
        spec = load_bundle_spec(directory)
        check_model_file(directory, spec)
        check_serves(directory, spec)
        if spec.name in models:
            raise BundleError(
                f"{directory / BUNDLE_FILE}: name {spec.name!r} is taken by another bundle"
            )
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
        )
        models[spec.name] = Model(spec.name, spec, ctx, engine, batcher)
        metrics.model_info.labels(
            spec.name,
            ",".join(spec.tasks),
            spec.precision,
            engine.provider,
            str(spec.max_seq_len),
        ).set(1)
        log.info(
            "loaded %s (%s, %s) on %s",
            spec.name,
            ",".join(spec.tasks),
            spec.precision,
            engine.provider,
        )
    for task, names in serving(models).items():
        marked = [n for n in names if models[n].spec.default]
        if len(marked) > 1:
            raise BundleError(f"{root}: bundles {marked} all say default for {task}; keep one")
    return models


def serving(models: dict[str, Model]) -> dict[str, list[str]]:
    """Task -> the names of the models serving it, the default first."""
    out: dict[str, list[str]] = {}
    for model in sorted(models.values(), key=lambda m: not m.spec.default):
        for task in model.spec.tasks:
            out.setdefault(task, []).append(model.name)
    return out


def defaults(models: dict[str, Model]) -> dict[str, Model]:
    """Task -> the model a request without ?model= gets (the one marked default, else the only)."""
    return {task: models[names[0]] for task, names in serving(models).items()}
