"""ONNX Runtime session for one bundle: the providers asked for (CUDA with CPU fallback, or a hard
requirement for CUDA), CUDA's options, intra-op threads sized to the cores, and on the CPU a
second session with more threads for a request alone on the machine (`lone_threads`). Warm-up is the
service's (ServiceState.warm_up); evaluation builds engines with its own options.

Provider selection is loud and honest: ONNX Runtime's own messages while it builds the session
(why CUDA failed, which nodes it left on the CPU) are caught off stderr and re-logged as JSON
lines of the `onnxruntime` logger; a session that asked for CUDA and got the CPU logs a warning
naming both and ORT's reason, and with `require_gpu` it is a one-line start-up error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, get_args

import numpy as np

from bertserve.runtime.bundle import SEGMENTS, BundleSpec, EngineName, OpenVINOPrecision
from bertserve.runtime.capabilities import ON_DEMAND
from bertserve.runtime.openvino import OPENVINO

log = logging.getLogger(__name__)
ort_log = logging.getLogger("onnxruntime")
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
CPU_PROVIDERS = (CPU, OPENVINO)  # what Engine.provider reads for a model on the CPU
# "bundle": the bundle's own field (EngineSpec), else ONNX Runtime / f32
ENGINES = ("bundle", *get_args(EngineName))
OPENVINO_PRECISIONS = ("bundle", *get_args(OpenVINOPrecision))
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# "2026-11-30 10:06:23.678 [W:onnxruntime:Default, file.cc:950 operator()] message" -> message
ORT_PREFIX = re.compile(r"^\S+ \S+ \[[A-Z]:onnxruntime:[^\]]*\]\s*")


class EngineError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineOptions:
    providers: str = "auto"  # "auto" (CUDA if this build has it, then CPU) or a list "A,B"
    threads: int = 1  # ONNX Runtime intra-op threads
    spinning: bool = False
    # With spinning: the threads spin only inside a call and sleep as soon as it ends
    # (ONNX Runtime's session.force_spinning_stop), so idle sessions leave the cores alone.
    spin_stop: bool = False
    # A second CPU session of each model with this many threads, spinning only within a call,
    # for the call of a request alone on the machine (`Engine.run(alone=True)`, chosen by the
    # batcher: runtime.batching.Activity). 0 or at most `threads`: none.
    lone_threads: int = 0
    require_gpu: bool = False
    # CUDA execution provider options (ignored on CPU).
    device_id: int = 0
    gpu_mem_limit: int = 0  # bytes for ORT's arena; 0: no limit
    arena_extend_strategy: str = "kNextPowerOfTwo"  # or kSameAsRequested
    cudnn_conv_algo_search: str = "EXHAUSTIVE"  # HEURISTIC, DEFAULT
    # The CPU memory arena (docs/deploy.md#memory; measured by `bertserve bench arena`):
    # "shrink" keeps it for calls up to SHRINK_AFTER x the warm-up's and gives back what a
    # larger call grew; "arena" keeps every high-water mark; "no-arena" allocates each tensor
    # from the system.
    cpu_arena: str = "shrink"
    # TF32 off: fp32 answers then match the CPU's within the export's 1e-4 (on, they differ by
    # about 1e-3). Speed on a GPU comes from fp16 bundles, not from TF32.
    use_tf32: bool = False
    # Which engine runs the model graph on the CPU (runtime.openvino): "ort", "openvino",
    # "auto" (both timed on the warm-up shapes at load, the faster kept if its answers agree),
    # or "bundle": the bundle's own `engine` field, else "ort". Heads in graphs of their own
    # stay on ONNX Runtime.
    engine: str = "bundle"
    # OpenVINO's inference precision: "f32", "bf16", or "bundle" (the bundle's field, else f32)
    openvino_precision: str = "bundle"

    def provider_list(self, available: list[str]) -> list[str]:
        if self.providers == "auto":
            return [p for p in (CUDA, CPU) if p in available]
        return self.providers.split(",")

    def cuda_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "device_id": self.device_id,
            "arena_extend_strategy": self.arena_extend_strategy,
            "cudnn_conv_algo_search": self.cudnn_conv_algo_search,
            "use_tf32": int(self.use_tf32),
        }
        if self.gpu_mem_limit:
            options["gpu_mem_limit"] = self.gpu_mem_limit
        return options


@contextlib.contextmanager
def ort_messages() -> Iterator[list[str]]:
    """ONNX Runtime writes its warnings to file descriptor 2 from C++: catch them while a
    session is built, and hand them back as lines (colours stripped)."""
    lines: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace")
            for line in text.splitlines():
                line = ORT_PREFIX.sub("", ANSI.sub("", line)).strip()
                if line and not line.startswith("warnings.warn("):
                    lines.append(line)


def preload_cuda_libraries() -> None:
    """Load CUDA and cuDNN from NVIDIA's pip wheels (the `gpu-wheels` extra) or the system's:
    the CUDA provider library has no RUNPATH, so outside a CUDA image it finds neither."""
    import onnxruntime as ort

    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    with ort_messages() as lines:
        try:
            preload()
        except Exception as exc:  # it reports, it should not stop the start
            lines.append(f"preload_dlls failed: {exc}")
    for line in lines:
        ort_log.info(line)


# A call over this many times the warm-up's largest gives back what it grew the CPU arena by.
# Smaller calls keep it: shrinking after every call over the warm-up's size cost 8-14% of a
# 32 x 48 MiniLM call (scripted, alternated), and such calls grow the arena little; the growth
# that stays is a long sequence's attention scores (rows x heads x length^2).
SHRINK_AFTER = 4
# A sparse head's MLM logits are a float a vocabulary entry a position (a 30,522-piece
# vocabulary: 122 kB a token, 1 GB for a call of the default 8,192 tokens), several copies of
# it live at once, and the sparse head runs without the CPU arena, so each call allocates them
# afresh. On a CPU a call is held to this much of one copy: 549 tokens for MiniLM (two rows of
# 256), which run 1.22x the tokens a second of 8,192-token calls and take 131 MiB a call, not
# 2,016 (`bertserve bench sparse`, docs/reports/sparse.md): a sparse bundle's batches
# (service.models.call_tokens), a sparse head's calls in a bundle of several heads (`_head`).
# A call holds at least one row of the model's length: a larger vocabulary (XLM-R's 250,002
# pieces) gets max_seq_len tokens a call.
VOCAB_CALL_BYTES = 64 * 2**20


def vocab_call_tokens(spec: BundleSpec) -> int:
    """The padded tokens a CPU call of a vocabulary-wide head may hold (VOCAB_CALL_BYTES)."""
    return max(spec.max_seq_len, VOCAB_CALL_BYTES // (4 * spec.tokenizer.vocab_size))


class Engine:
    def __init__(self, directory: Path, spec: BundleSpec, options: EngineOptions) -> None:
        import onnxruntime as ort

        if spec.sparse is not None and "sparse_embeddings" not in spec.heads:
            # A sparse head's (rows x length x vocabulary) logits would stay in the CPU arena
            # after the warm-up: 850 MiB more a worker for MiniLM at rest, past the memory the
            # deployment is sized for (docs/deploy.md#memory). Without the arena they are given
            # back after each call, for calls 19-31% slower (docs/deploy.md#memory). A head in
            # a graph of its own runs so alone (`_head_options`): its encoder keeps the arena.
            options = replace(options, cpu_arena="no-arena")
        available = ort.get_available_providers()
        requested = options.provider_list(available)
        missing = [p for p in requested if p not in available]
        if missing:
            raise EngineError(
                f"providers {missing} are not in this ONNX Runtime build (available: {available})"
            )
        if CUDA in requested:
            preload_cuda_libraries()
        path = directory / spec.model_file
        providers: list[Any] = [(p, options.cuda_options()) if p == CUDA else p for p in requested]
        session, messages = self._session(ort, path, providers, options, options.threads)
        for line in messages:
            ort_log.warning(line, extra={"fields": {"onnxruntime": line, "model": spec.name}})
        if isinstance(session, Exception):
            raise EngineError(f"{path}: ONNX Runtime cannot load it: {session}") from session
        self.session = session
        self.provider = self.session.get_providers()[0]
        self.requested = requested[0] if requested else CPU
        if self.provider != self.requested:
            reason = next((m for m in messages if "CUDA" in m or "cuda" in m), "no reason given")
            log.warning(
                "%s asked for %s and runs on %s: %s",
                spec.name,
                self.requested,
                self.provider,
                reason,
                extra={
                    "fields": {
                        "message": "provider fallback",
                        "model": spec.name,
                        "requested": self.requested,
                        "in_use": self.provider,
                        "reason": reason,
                    }
                },
            )
            if options.require_gpu:
                raise EngineError(
                    f"BERTSERVE_REQUIRE_GPU is set but {spec.name} runs on {self.provider}: "
                    f"{reason}"
                )
        elif options.require_gpu and self.provider != CUDA:
            raise EngineError(
                f"BERTSERVE_REQUIRE_GPU is set but {spec.name} runs on {self.provider} "
                f"(this ONNX Runtime build offers {available})"
            )
        if spec.precision == "fp16" and self.provider == CPU:
            log.warning(
                "%s is an fp16 bundle on the CPU, where it is slower than fp32 or int8: "
                "serve an int8 or fp32 bundle on CPUs",
                spec.name,
            )
        # The lone session: on the CPU only (a GPU call does not share the cores).
        self.lone_session: Any = None
        if self.provider == CPU and options.lone_threads > options.threads:
            lone, messages = self._session(ort, path, [CPU], options, options.lone_threads)
            if isinstance(lone, Exception):
                raise EngineError(f"{path}: ONNX Runtime cannot load it: {lone}") from lone
            self.lone_session = lone
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.inputs = [i.name for i in self.session.get_inputs()]
        if self.inputs != spec.inputs or self.outputs != spec.graph_outputs:
            raise EngineError(
                f"{path}: graph inputs/outputs {self.inputs}/{self.outputs} differ from bundle.json"
            )
        self.served = [o for o in self.outputs if o not in ON_DEMAND]  # what a call returns
        # Heads in graphs of their own (bundle.json "heads"): run on the model graph's token
        # states only for a call that asks for their outputs (`extra`), each (with its lone
        # twin) a session of its own.
        self.heads: dict[str, tuple[str, Any, Any]] = {}
        self.head_tokens: dict[str, int] = {}
        for name, head in spec.heads.items():
            head_path = directory / head.file
            sessions: list[Any] = []
            for lone, threads in ((False, options.threads), (True, options.lone_threads)):
                if lone and self.lone_session is None:  # none for the model graph: none here
                    sessions.append(None)
                    continue
                head_options = self._head_options(name, options)
                made, messages = self._session(ort, head_path, providers, head_options, threads)
                if isinstance(made, Exception):
                    raise EngineError(f"{head_path}: ONNX Runtime cannot load it: {made}") from made
                sessions.append(made)
            names = (
                [i.name for i in sessions[0].get_inputs()],
                [o.name for o in sessions[0].get_outputs()],
            )
            if names != ([head.input, "attention_mask"], [name]):
                raise EngineError(
                    f"{head_path}: head inputs/outputs {names} differ from bundle.json "
                    f"({[head.input, 'attention_mask']}, {[name]})"
                )
            self.heads[name] = (head.input, sessions[0], sessions[1])
            if name == "sparse_embeddings" and self.provider == CPU:
                self.head_tokens[name] = vocab_call_tokens(spec)
        self.outputs = self.outputs + list(self.heads)
        self.engine_name = "onnxruntime"
        self.engine_choice: dict[str, Any] = {}
        if self.provider == CPU:
            self._choose_engine(directory, spec, options)

        # A family without segments (RoBERTa's) has no token_type_ids input; the batcher's
        # feeds carry it for every graph, and it is left out here.
        self._segmentless = SEGMENTS not in self.inputs
        self.cpu_arena = options.cpu_arena
        self.warm_tokens = 0  # the largest call so far while warming up (`warmed`)
        self._warming = True
        if self.cpu_arena == "shrink" and self.provider == CPU:
            self._shrink: Any = ort.RunOptions()
            self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        else:
            self._shrink = None

    def _choose_engine(self, directory: Path, spec: BundleSpec, options: EngineOptions) -> None:
        """Put the model graph on OpenVINO where asked (or, with `auto`, where it measures
        faster on the warm-up shapes and answers within the precision's tolerance), and say
        why in `engine_choice` and the log."""
        from bertserve.runtime import openvino

        if options.engine not in ENGINES or options.openvino_precision not in OPENVINO_PRECISIONS:
            raise EngineError(
                f"engine {options.engine!r} / openvino_precision {options.openvino_precision!r}: "
                f"the engine is one of {ENGINES}, the precision one of {OPENVINO_PRECISIONS}"
            )
        wanted = options.engine
        if wanted == "bundle":
            wanted = spec.engine.name if spec.engine is not None else "ort"
        precision = options.openvino_precision
        if precision == "bundle":
            precision = spec.engine.openvino_precision if spec.engine is not None else "f32"
        if wanted == "ort":
            return
        choice: dict[str, Any] = {"asked": wanted, "openvino_precision": precision}
        self.engine_choice = choice
        path = directory / spec.model_file
        names = tuple(self.inputs + self.served_all)
        feeds = [
            {k: v for k, v in f.items() if k in self.inputs}
            for f in warmup_feeds(spec, 32, 32 * 32)
        ]
        try:
            candidate = self._openvino_candidate(path, options.threads, precision, names, feeds)
        except _Unfit as unfit:
            choice.update(chosen="onnxruntime", reason=str(unfit))
            if wanted == "openvino":
                raise EngineError(
                    f"{spec.name}: engine openvino was asked for, but {unfit}"
                ) from None
            log.info("%s stays on ONNX Runtime: %s", spec.name, unfit, extra={"fields": choice})
            return
        if wanted == "auto":
            ort_ms, ov_ms = _time_both(self.session, candidate, feeds, self.served_all)
            choice.update(onnxruntime_ms=round(ort_ms, 3), openvino_ms=round(ov_ms, 3))
            if ov_ms >= ort_ms:
                choice.update(chosen="onnxruntime", reason="ONNX Runtime measured faster")
                log.info("%s: auto keeps ONNX Runtime", spec.name, extra={"fields": choice})
                return
            choice["reason"] = "OpenVINO measured faster"
        else:
            choice["reason"] = "asked for"
        choice["chosen"] = "openvino"
        self.session = candidate
        if self.lone_session is not None:
            self.lone_session = openvino.OpenVINOSession(
                path, options.lone_threads, precision, names
            )
        self.provider = OPENVINO
        self.engine_name = "openvino"
        log.info("%s runs on OpenVINO (%s)", spec.name, choice["reason"], extra={"fields": choice})

    def _openvino_candidate(
        self,
        path: Path,
        threads: int,
        precision: str,
        names: tuple[str, ...],
        feeds: list[dict[str, np.ndarray]],
    ) -> Any:
        """The graph on OpenVINO, its answers on `feeds` checked against this session's within
        the precision's tolerance (the figures noted in engine_choice); _Unfit says why not."""
        from bertserve.runtime import openvino

        problem = openvino.available()
        if problem is not None:
            raise _Unfit(problem)
        try:
            candidate = openvino.OpenVINOSession(path, threads, precision, names)
        except Exception as exc:  # OpenVINO's own exception types
            # a graph it cannot convert, or a node its CPU plugin has no kernel for here
            raise _Unfit(
                "OpenVINO cannot read or compile it: " + " ".join(str(exc).split())[-300:]
            ) from None
        read = ([p.name for p in candidate.get_inputs()], [p.name for p in candidate.get_outputs()])
        if sorted(read[0]) != sorted(self.inputs) or sorted(read[1]) != sorted(self.served_all):
            raise _Unfit(f"OpenVINO's graph inputs/outputs {read} differ from ONNX Runtime's")
        choice = self.engine_choice
        choice["precision_in_use"] = candidate.precision_in_use
        tolerance = BF16_TOLERANCE if candidate.precision_in_use == "bf16" else FP32_TOLERANCE
        difference = max(
            _relative(a, b)
            for f in feeds
            for a, b in zip(
                self.session.run(self.served_all, f),
                candidate.run(self.served_all, f),
                strict=True,
            )
        )
        choice["difference"] = float(f"{difference:.3g}")
        choice["tolerance"] = tolerance
        if difference > tolerance:
            raise _Unfit(f"OpenVINO's answers differ by {difference:.2g} (tolerance {tolerance:g})")
        return candidate

    @property
    def served_all(self) -> list[str]:
        """The model graph's outputs (heads in graphs of their own left out)."""
        return [o for o in self.outputs if o not in self.heads]

    @staticmethod
    def _head_options(name: str, options: EngineOptions) -> EngineOptions:
        """A vocabulary-wide head (SPLADE's MLM logits at every position) runs without the CPU
        arena, as a sparse bundle's whole graph does; other heads as the model graph."""
        if name == "sparse_embeddings":
            return replace(options, cpu_arena="no-arena")
        return options

    @staticmethod
    def _session(
        ort: Any, path: Path, providers: list[Any], options: EngineOptions, threads: int
    ) -> tuple[Any, list[str]]:
        """A session (or the exception that stopped it) and ORT's messages while it was built.
        More threads than `options.threads` make the lone session: its threads spin within a
        call (two sleeping threads gave a lone MiniLM request less than two thirds of the gain,
        docs/performance.md) and sleep when it ends, so they leave the cores to the rest."""
        lone = threads > options.threads
        spinning = options.spinning or lone
        session_options = ort.SessionOptions()
        session_options.intra_op_num_threads = threads
        session_options.inter_op_num_threads = 1
        session_options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if spinning else "0"
        )
        if spinning and (options.spin_stop or lone):
            session_options.add_session_config_entry("session.force_spinning_stop", "1")
        session_options.log_severity_level = 2  # warnings too: caught and re-logged
        session_options.enable_cpu_mem_arena = options.cpu_arena != "no-arena"
        with ort_messages() as messages:
            try:
                session = ort.InferenceSession(str(path), session_options, providers=providers)
            except Exception as exc:  # ORT's own exception types
                return exc, messages
        return session, messages

    @property
    def runs_alone(self) -> bool:
        """Whether `run(alone=True)` has a session of its own with more threads."""
        return self.lone_session is not None

    def warmed(self) -> None:
        """The warm-up is over: a call larger than its largest now gives its growth back."""
        self._warming = False

    def run(
        self, feeds: dict[str, np.ndarray], alone: bool = False, extra: tuple[str, ...] = ()
    ) -> dict[str, np.ndarray]:
        """The outputs by name: the graph's, less those computed on demand
        (runtime.capabilities.ON_DEMAND) unless `extra` names them. `alone`: nothing else runs
        on the machine now; the call takes the lone session, if there is one (`runs_alone`)."""
        ids = feeds["input_ids"]
        if self._segmentless and SEGMENTS in feeds:
            feeds = {name: value for name, value in feeds.items() if name != SEGMENTS}
        options = None
        if self._shrink is not None:
            if self._warming:
                self.warm_tokens = max(self.warm_tokens, ids.size)
            elif ids.size > SHRINK_AFTER * self.warm_tokens:
                options = self._shrink
        session = self.lone_session if alone and self.lone_session is not None else self.session
        names = self.served
        if extra:
            names = names + [n for n in self.outputs if n in extra and n not in names]
        heads = [n for n in names if n in self.heads]
        fetch = [n for n in names if n not in self.heads]
        needed = [self.heads[n][0] for n in heads if self.heads[n][0] not in fetch]
        fetch += list(dict.fromkeys(needed))
        out = dict(zip(fetch, session.run(fetch, feeds, options), strict=True))
        for name in heads:
            out[name] = self._head(name, out[self.heads[name][0]], feeds["attention_mask"], alone)
        return {name: out[name] for name in names}

    def _head(self, name: str, states: np.ndarray, mask: np.ndarray, alone: bool) -> np.ndarray:
        """A head's output for a call: over its token states, in calls of at most
        `head_tokens` padded tokens where its per-position output is vocabulary-wide (the
        encoder's call stays whole; only the head's buffer is bounded)."""
        source, shared, lone = self.heads[name]
        session = lone if alone and lone is not None else shared
        rows, length = mask.shape
        step = rows
        if name in self.head_tokens:
            step = max(1, self.head_tokens[name] // max(1, length))
        parts = [
            session.run(
                [name], {source: states[i : i + step], "attention_mask": mask[i : i + step]}
            )[0]
            for i in range(0, rows, step)
        ]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


# How far another engine's answers may be from ONNX Runtime's, as a fraction of the largest
# output: fp32's export tolerance, and bfloat16 matrix products' (8 bits of mantissa; MiniLM's
# outputs measured 0.5-1.5e-2 of the largest, docs/reports/engines.md).
FP32_TOLERANCE = 1e-4
BF16_TOLERANCE = 5e-2
CLEAR_LOSS = 4.0  # _time_both: a session this many times slower has lost
TIMING_ROUNDS = 5


class _Unfit(Exception):
    """Why OpenVINO cannot serve a graph here (Engine._openvino_candidate)."""


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference as a fraction of `a`'s largest value; infinite where `b` holds a
    NaN or an infinity `a` does not (NaN compares below every tolerance)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not a.size:
        return 0.0
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return float("inf")
    finite = np.isfinite(a)
    if not finite.any():
        return 0.0
    return float(np.abs(a - b)[finite].max() / max(float(np.abs(a[finite]).max()), 1e-9))


def _time_both(
    first: Any, second: Any, feeds: list[dict[str, np.ndarray]], names: list[str]
) -> tuple[float, float]:
    """Each session's summed median milliseconds over the feeds, the two alternated call by
    call (so a neighbour's load falls on both), after a call of each to warm the shapes. Once
    one session's first timed call takes CLEAR_LOSS times the other's, the timing stops there
    and the totals are over the shapes timed so far: OpenVINO bf16 on reference kernels took
    5.8 s a pass against 0.15 s (docs/reports/engines.md), and seven passes would hold a
    worker's start for 40 s to learn what one says."""
    import time

    totals = [0.0, 0.0]
    for f in feeds:
        times: list[list[float]] = [[], []]
        for session in (first, second):
            session.run(names, f)
        for r in range(TIMING_ROUNDS):
            for i, session in enumerate((first, second)):
                start = time.perf_counter()
                session.run(names, f)
                times[i].append(time.perf_counter() - start)
            if r == 0 and _clear_loss(times[0][0], times[1][0]):
                break
        for i in (0, 1):
            totals[i] += float(np.median(times[i])) * 1000
        if _clear_loss(*totals):
            break
    return totals[0], totals[1]


def _clear_loss(a: float, b: float) -> bool:
    return max(a, b) > CLEAR_LOSS * min(a, b)


def warmup_feeds(
    spec: BundleSpec, max_batch_rows: int, max_batch_tokens: int
) -> list[dict[str, np.ndarray]]:
    """Representative shapes: one short row, a full batch, the longest sequences."""
    shapes = []
    for rows, length in ((1, 16), (max_batch_rows, 32), (2, spec.max_seq_len)):
        rows = max(1, min(rows, max_batch_tokens // length))
        feeds = {
            "input_ids": np.full((rows, length), spec.tokenizer.unk_id, np.int64),
            "attention_mask": np.ones((rows, length), np.int64),
            "token_type_ids": np.zeros((rows, length), np.int64),
        }
        if "mask_positions" in spec.inputs:
            feeds["mask_positions"] = np.ones((rows, 1), np.int64)
        shapes.append({name: value for name, value in feeds.items() if name in spec.inputs})
    return shapes
