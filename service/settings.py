"""Service settings: environment variables with the `BERTSERVE_` prefix (or CLI flags), validated
once at start-up with messages that name the variable."""

from __future__ import annotations

import argparse
import functools
import os
import types
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bertserve.runtime.engine import EngineOptions
from bertserve.runtime.schemas import PRIORITIES
from bertserve.runtime.tasks.common import RequestLimits
from bertserve.service.http.auth import MIN_KEY_LENGTH
from bertserve.service.tenants import DEFAULT, KeysFileError, Tenants, read_keys_file

KNOWN_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
CGROUP = Path("/sys/fs/cgroup")


def available_cores(cgroup: Path = CGROUP) -> int:
    """The cores this process may use: its CPU affinity, capped by a container's CPU quota
    (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`) rounded up.
    `os.cpu_count()` is the host's: in a container limited to 2 CPUs on a 64-core node it says
    64, and 64 workers with their own models would not fit the container's memory."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = period = None
    try:
        fields = (cgroup / "cpu.max").read_text().split()
        if fields and fields[0] != "max":
            quota, period = int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        try:
            quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
            period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            pass
    if quota is not None and period and quota > 0:
        cores = min(cores or 1, -(-quota // period))
    return max(1, cores or 1)


def split_keys(*secrets: SecretStr | None) -> tuple[bytes, ...]:
    """The comma-separated bearer tokens of `secrets`, together."""
    joined = ",".join(s.get_secret_value() for s in secrets if s is not None)
    return tuple(k.strip().encode() for k in joined.split(",") if k.strip())


# The settings by concern, in the order `bertserve serve --help` and docs/api.md list them
# (tests/service/test_settings.py: every field in exactly one group).
GROUPS: dict[str, tuple[str, ...]] = {
    "models and engine": (
        "bundles",
        "model_control",
        "load_at_start",
        "model_memory_mb",
        "model_load_timeout_s",
        "warmup",
        "providers",
        "engine",
        "openvino_precision",
        "require_gpu",
        "device_id",
        "gpu_mem_limit",
        "arena_extend_strategy",
        "cpu_arena",
        "cudnn_conv_algo_search",
        "use_tf32",
        "intra_op_threads",
        "intra_op_spinning",
        "intra_op_spin_stop",
        "lone_threads",
        "failed_batches_fatal",
    ),
    "batching and admission": (
        "max_batch_rows",
        "max_batch_tokens",
        "max_wait_ms",
        "bulk_nice",
        "split_batches",
        "max_queue_rows",
        "max_bulk_queue_rows",
        "max_queue_wait_ms",
        "max_queue_time_ms",
        "request_timeout_s",
        "default_priority",
        "bulk_priority",
        "priority_aging_s",
        "max_in_flight",
        "max_queued_batches",
        "queue_min_body_bytes",
        "max_queued_bytes",
        "max_receiving",
        "refusal_delay_ms",
        "inline_cost",
    ),
    "limits of a request": (
        "max_client_batch",
        "max_request_rows",
        "max_rerank_documents",
        "max_body_bytes",
        "max_response_bytes",
        "max_fill_mask_candidates",
        "max_text_chars",
        "auto_truncate",
        "long_input",
    ),
    "HTTP and security": (
        "host",
        "port",
        "grpc_port",
        "grpc_reflection",
        "root_task",
        "max_header_bytes",
        "header_timeout_s",
        "body_timeout_s",
        "body_min_rate",
        "keep_alive_s",
        "max_connections",
        "max_anonymous_connections",
        "api_key",
        "api_keys",
        "keys_file",
        "admin_keys",
        "metrics_token",
        "metrics_cache_s",
        "log_level",
    ),
    "tracing": (
        "otlp_endpoint",
        "otlp_sample_ratio",
        "otlp_service_name",
        "otlp_export_delay_ms",
    ),
    "processes": (
        "workers",
        "engine_process",
        "engine_threads",
        "engine_call_timeout_s",
        "max_worker_rss_mb",
        "drain_timeout_s",
    ),
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BERTSERVE_", extra="forbid", frozen=True)
    # --- models and engine ---

    bundles: Path = Field(
        Path("bundles"),
        description="directory of bundles to serve, one a subdirectory named as its bundle: "
        "the model repository",
    )
    model_control: Literal["static", "explicit"] = Field(
        "static",
        description="static: every bundle of the repository is loaded at start, and the set "
        "stays; explicit: only load_at_start's, and the management API (admin_keys) loads, "
        "replaces and unloads models while the service runs (docs/api.md#model-management)",
    )
    load_at_start: str = Field(
        "",
        description="with explicit model control: the comma-separated bundle names loaded at "
        "start ('*': every one); the rest are loaded by POST /models/{name}/load",
    )
    model_memory_mb: float = Field(
        0,
        ge=0,
        description="with explicit model control: a request naming a repository model that is "
        "not loaded loads it (the request waits, within request_timeout_s), and the least "
        "recently used models are unloaded to keep what the loaded models take within this "
        "many MB a worker; 0: off (such a request is a 404)",
    )
    model_load_timeout_s: float = Field(
        300.0,
        gt=0,
        description="a management call answers 504 if the change is not complete in every "
        "worker by then (it goes on; GET /models shows its state)",
    )
    warmup: bool = Field(
        True,
        description="run representative shapes through every model before readiness, so the "
        "first requests do not pay for ONNX Runtime's first calls (it also finds whether a "
        "fill-mask graph runs without mask slots, which lets /nsp rows skip the MLM head)",
    )
    providers: str = Field(
        "auto",
        description="ONNX Runtime execution providers: 'auto' (CUDA if this build has it, then "
        "CPU) or a comma-separated list of CUDAExecutionProvider, CPUExecutionProvider",
    )
    engine: Literal["bundle", "ort", "openvino", "auto"] = Field(
        "bundle",
        description="the CPU engine of each model graph: 'ort' (ONNX Runtime), 'openvino' "
        "(the openvino extra; a graph it cannot read is a load error), 'auto' (both timed on "
        "the warm-up shapes at load, the faster kept where the answers agree; the figures in "
        "the log and /models), or 'bundle': the bundle's own engine field, else ort "
        "(docs/reports/engines.md)",
    )
    openvino_precision: Literal["bundle", "f32", "bf16"] = Field(
        "bundle",
        description="OpenVINO's inference precision: f32 (ONNX Runtime's answers within 1e-4) "
        "or bf16 (AVX-512 BF16 or AMX CPUs, f32 elsewhere; about 1e-2 of the largest "
        "output); 'bundle': the bundle's field, else f32",
    )
    require_gpu: bool = Field(
        False, description="refuse to start unless CUDA is the active provider"
    )
    device_id: int = Field(0, ge=0, description="CUDA device (one process per device)")
    gpu_mem_limit: int = Field(0, ge=0, description="bytes for ONNX Runtime's CUDA arena; 0: none")
    arena_extend_strategy: Literal["kNextPowerOfTwo", "kSameAsRequested"] = Field(
        "kNextPowerOfTwo", description="how ONNX Runtime's CUDA arena grows"
    )
    cpu_arena: Literal["shrink", "arena", "no-arena"] = Field(
        "shrink",
        description="ONNX Runtime's CPU memory arena: 'shrink' gives back what a call larger "
        "than the warm-up's grew it by; 'arena' keeps every high-water mark; 'no-arena' "
        "allocates from the system (docs/deploy.md#memory)",
    )
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = Field(
        "EXHAUSTIVE", description="cuDNN's convolution algorithm search on CUDA"
    )
    use_tf32: bool = Field(
        False, description="TF32 matmuls on CUDA: faster fp32, answers ~1e-3 from the CPU's"
    )
    intra_op_threads: int = Field(
        0, ge=0, description="ONNX Runtime threads a process; 0: its share of the cores"
    )
    # Off, unlike ORT's default: the event loop shares the cores with ORT's threads, and threads
    # spinning between calls starve it
    # (docs/performance.md#choices-and-the-measurement-behind-each).
    intra_op_spinning: bool = Field(
        False, description="let ONNX Runtime's threads busy-wait for work between calls"
    )
    intra_op_spin_stop: bool = Field(
        False,
        description="with intra_op_spinning: threads spin only within a call and sleep when it "
        "ends",
    )
    # A lone request on a worker's one thread took 1.4x (MiniLM) the time of a plain server's
    # call on both cores (docs/performance.md#what-limits-it); a second session of each
    # model gives it every core, for the memory that session holds (docs/deploy.md#memory).
    lone_threads: int = Field(
        0,
        ge=0,
        description="ONNX Runtime threads for the call of a request alone in the service (one "
        "row, no other request in flight in any worker), from a second session of each model "
        "on the CPU; "
        "0: the threads of all workers together (workers x intra_op_threads: every core by "
        "default); 1 (or no more than intra_op_threads): no second session, and its memory "
        "saved (docs/deploy.md#memory)",
    )
    failed_batches_fatal: int = Field(
        3,
        ge=1,
        description="consecutive failed model calls after which the process reports itself "
        "dead (liveness and readiness fail): a CUDA error leaves the context unusable",
    )

    # --- batching and admission ---
    max_batch_rows: int = Field(32, ge=1, description="sequences in one model call")
    max_batch_tokens: int = Field(
        8192, ge=16, description="padded tokens (rows x length) in a call"
    )
    max_wait_ms: float = Field(
        0.0,
        ge=0,
        description="how long an idle model waits for a batch to fill; 0: run what is queued",
    )
    bulk_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="OS niceness of the thread that runs calls holding only client batches' "
        "rows: interactive work on the same cores (another model's call, the event loop) gets "
        "the CPU first; 0: the same priority",
    )
    split_batches: bool = Field(
        True,
        description="run queued sequences of very different lengths as separate calls where "
        "the padding would cost more model time than another call (measured as it serves)",
    )
    max_queue_rows: int = Field(
        512,
        ge=1,
        description="interactive sequences (requests of one input) admitted per model; past it 429",
    )
    max_bulk_queue_rows: int = Field(
        4096,
        ge=1,
        description="sequences of client batches (requests of more than one input) a model may "
        "hold queued behind the interactive ones; they are also refused once the model could not "
        "clear them within half of request_timeout_s at its measured rate",
    )
    max_queue_wait_ms: float = Field(
        500.0,
        ge=0,
        description="work a model's queue may hold, at the rate the model has been serving: past "
        "it 429, so what is admitted is answered in time; 0: the row limit only",
    )
    max_queue_time_ms: float = Field(
        750.0,
        ge=0,
        description="by when an admitted request's first model call must end, from its arrival "
        "(plus the batch window, max_wait_ms), at the call time measured so far: a request whose "
        "call would end later is answered 429 with Retry-After instead of late, though it may "
        "always wait out the batch the model was busy with when it arrived. The bound on "
        "max_queue_wait_ms's estimate, which an event loop busy with a flood can outrun; 0: off",
    )
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request's deadline, post-processing included: 504 past it (a client that "
        "left is logged 499)",
    )
    default_priority: int = Field(
        0,
        ge=PRIORITIES[0],
        le=PRIORITIES[1],
        description="the priority of a request of one input that names none (lower is served "
        "first: Cohere's and vLLM's `priority`)",
    )
    bulk_priority: int = Field(
        1,
        ge=PRIORITIES[0],
        le=PRIORITIES[1],
        description="the priority of a client batch (more than one input) that names none: "
        "below single interactive inputs",
    )
    priority_aging_s: float = Field(
        10.0,
        gt=0,
        description="ageing: a queued sequence rises one priority level for every this many "
        "seconds it has waited, so a lower priority is not passed over for long",
    )
    # What bounds an admitted request's time under overload: an event loop busy refusing a flood
    # completes about 500 requests a second, so at 256 in flight (the old default) the served took
    # 0.45-0.49 s at the median and 1-2.3% of answers came after 1 s; at 64, 0.11-0.13 s and
    # 0.07-0.36%, with as many served (docs/performance.md#choices-and-the-measurement-behind-each).
    # The benches saturate the students with 16 connections a process, well inside it.
    max_in_flight: int = Field(
        64,
        ge=1,
        description="requests a process handles at once (counted from a request's complete "
        "body); past it 503 with Retry-After, at the headers or, for a body that completes "
        "when the cap is full, then",
    )
    max_queued_batches: int = Field(
        512,
        ge=0,
        description="client batches (requests of more than one input) a process admits past "
        "max_in_flight: they wait in the model's bulk lane, bounded by max_bulk_queue_rows and "
        "its time bound, instead of a 503; a request of one input past max_in_flight is still "
        "refused; 0: none",
    )
    queue_min_body_bytes: int = Field(
        256,
        ge=0,
        description="past max_in_flight, only a task request whose body declares at least this "
        "many bytes (Content-Length) may wait as a client batch; a smaller one (a single short "
        "text) is refused at the headers, where a flood of them costs least",
    )
    max_queued_bytes: int = Field(
        64_000_000,
        ge=0,
        description="the bodies of the client batches queued past max_in_flight, a process "
        "(Content-Length; a chunked body counts as max_body_bytes): what they may hold in "
        "memory, with their parsed texts, stays a few times this",
    )
    max_receiving: int = Field(
        256,
        ge=1,
        description="admitted requests a process holds while their bodies arrive (they hold no "
        "in-flight slot yet); past it 503 with Retry-After at the headers",
    )
    # A client that retries a refusal at once, ignoring Retry-After, turns refusals into most of
    # the server's work: on 2 cores the CPU they take slows the model, its measured rate falls,
    # and more is refused (a retry storm; /qa at 32 such clients answered 15-19 req/s).
    refusal_delay_ms: float = Field(
        50.0,
        ge=0,
        description="overload refusals (429, and 503 past max_in_flight) are answered after this "
        "delay, so clients that retry at once cannot make refusing most of the work; 0: at once",
    )
    inline_cost: int = Field(
        4096,
        ge=0,
        description="requests carrying more characters tokenise and decode on a worker "
        "thread, so the event loop stays responsive",
    )

    # --- limits of a request ---
    # OpenAI's limit: langchain-openai sends 1,000 texts a request by default, llama-index 100,
    # chromadb a whole add() at once. Each input is a row of the batcher, which runs them in
    # batches of max_batch_rows with every other client's.
    max_client_batch: int = Field(2048, ge=1, description="inputs in one request")
    # 256: a 17,500-token article (the longest of SQuAD v1.1 dev) in chunks of 128 pieces.
    max_request_rows: int = Field(
        256,
        ge=1,
        description="sequences one request may become (the windows of long texts), or as many "
        "as it has inputs if that is more; at most the queue bound of its lane "
        "(max_queue_rows for a request of one input, max_bulk_queue_rows for a client batch); "
        "past it 413",
    )
    max_rerank_documents: int = Field(
        256, ge=1, description="documents one rerank request may rank (a row each)"
    )
    # 2,048 texts of a thousand characters; text-embeddings-inference's default is 2 MB.
    max_body_bytes: int = Field(4_000_000, ge=1024, description="largest request body; past it 413")
    # 2,048 vectors of 1,024 floats as JSON (at most 15 bytes a float): a request that would pass
    # it is refused before its work where its size is known ahead (embeddings), else after.
    max_response_bytes: int = Field(32_000_000, ge=1024, description="largest answer; past it 413")
    max_fill_mask_candidates: int = Field(
        1000, ge=1, description="inputs x [MASK]s x top_k one /fill-mask request may ask for"
    )
    max_text_chars: int = Field(100_000, ge=16, description="longest text accepted at all")
    auto_truncate: bool = Field(
        False,
        description="cut inputs longer than the model takes, instead of a 413, where a request "
        "does not say (`truncate` left out on /embed, /similarity, /rerank and /v1/embeddings), "
        "as text-embeddings-inference's --auto-truncate",
    )
    long_input: Literal["error", "truncate", "chunk"] = Field(
        "error",
        description="what an input longer than the model's window gets where a request does not "
        "say (`long_input`, or `truncate`) on /embed, /v1/embeddings, /similarity, /classify, "
        "/rerank and /v1/rerank: a 413 (error), cut (truncate; as auto_truncate), or cut into "
        "chunks whose answers are combined (chunk: docs/api.md#long-inputs)",
    )

    # --- HTTP and security ---
    host: str = Field(
        "127.0.0.1",
        description="listen address; 0.0.0.0 (or ::) serves other machines: set API keys then",
    )
    port: int = Field(8000, ge=0, le=65535, description="0: any free port (the ready line says)")
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="serve gRPC (text-embeddings-inference's tei.v1 services, the Open "
        "Inference Protocol's GRPCInferenceService, grpc.health.v1) on this port too; 0: any "
        "free port; unset: no gRPC",
    )
    grpc_reflection: bool = Field(False, description="serve gRPC server reflection")
    # --- tracing ---
    otlp_endpoint: str | None = Field(
        None,
        description="export OpenTelemetry traces over OTLP/gRPC to this endpoint "
        "(http://collector:4317); unset: no tracing. Needs the otel extra",
    )
    otlp_sample_ratio: float = Field(
        1.0, ge=0, le=1, description="share of requests traced (a caller's sampled flag wins)"
    )
    otlp_service_name: str = Field("bertserve", min_length=1, description="service.name")
    otlp_export_delay_ms: int = Field(
        1000, ge=1, description="how often finished spans are sent, in batches"
    )
    root_task: str = Field(
        "/embed",
        description="the task POST / answers (text-embeddings-inference's and Hugging Face "
        "InferenceClient's base URL); a body whose inputs hold a source_sentence goes to "
        "/similarity",
    )
    max_header_bytes: int = Field(
        32_768,
        ge=1024,
        description="largest request line and headers; past it 431 and the connection closed",
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="a client must send its request headers within this"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="and its body within this; past either, 408 and close"
    )
    # A body's deadline grows with its bytes (as Apache's mod_reqtimeout MinRate): a client that
    # sends a byte now and then holds a receiving slot for BODY_GRACE_S, not body_timeout_s, so
    # holding every slot (max_receiving) takes many new requests a second, not a few a minute.
    body_min_rate: float = Field(
        500.0,
        ge=0,
        description="bytes/s a body must keep up after its first 5 s (the deadline is 5 s plus "
        "a second for each this many bytes, at most body_timeout_s); slower: 408 and close; "
        "0: off",
    )
    # uvicorn's default is 5 s. A client that reuses a connection in the instant the server closes
    # it for idleness has its request reset, unanswered (the overload runs' resets,
    # docs/performance.md#choices-and-the-measurement-behind-each): the server's idle timeout must
    # be longer than its clients' and proxies' (nginx's default is 75 s; AWS ALB idles 60 s).
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        description="an idle kept-alive connection is closed after this; keep it above the idle "
        "timeout of the clients and proxies in front (docs/deploy.md)",
    )
    max_connections: int = Field(
        2048,
        ge=1,
        description="open connections a process serves; a request on one past it is answered "
        "503 with Retry-After and that connection closed (the process raises its open-file "
        "limit to fit, where the hard limit allows)",
    )
    max_anonymous_connections: int = Field(
        256,
        ge=1,
        description="with API keys set: connections that have not sent a valid key a process "
        "keeps; past it the oldest idle ones are closed, and their requests refused 503, so "
        "clients without a key cannot take the connections keyed clients need",
    )
    api_key: SecretStr | None = Field(None, description="one bearer token (see api_keys)")
    api_keys: SecretStr | None = Field(
        None,
        description="comma-separated bearer tokens of 16 or more characters, any of which is "
        "accepted: rotate by adding "
        "the new key, moving clients, then removing the old; health and /metrics stay open",
    )
    keys_file: Path | None = Field(
        None,
        description="a TOML file of tenants, one table each: its keys, its weight (its share of "
        "each model's time and of the in-flight, receiving and queued places against the "
        "other tenants) and its requests' default priority (docs/deploy.md); api_keys together "
        "are one more tenant, 'default', of weight 1",
    )
    admin_keys: SecretStr | None = Field(
        None,
        description="comma-separated bearer tokens of 16 or more characters for the management "
        "API (POST /models/{name}/load and /unload), apart from api_keys, which it refuses "
        "(403); unset: the management API is off",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="a bearer token /metrics then asks for (Prometheus' authorization "
        "credentials); unset: /metrics is open, like the probes",
    )
    metrics_cache_s: float = Field(
        1.0,
        ge=0,
        description="a /metrics scrape is reused for this long, so scraping in a loop costs a "
        "copy, not a collection; 0: collected on every scrape",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="the JSON log's level (one line a request at info)"
    )

    # --- processes ---
    workers: int = Field(
        0,
        ge=0,
        description="serving processes sharing the port, each with its own models and a share "
        "of the cores; 0: one per core this process may use (its CPU affinity, capped by a "
        "container's CPU quota; docs/deploy.md sizes them)",
    )
    engine_process: bool = Field(
        False,
        description="one process runs every model for all workers, which keep HTTP, JSON, "
        "tokenising and batching and send it their batches: on a GPU, one CUDA context and "
        "the batches of all workers together; on a CPU it costs throughput (docs/deploy.md)",
    )
    engine_threads: int = Field(
        0, ge=0, description="ONNX Runtime threads of the engine process; 0: one a core"
    )
    engine_call_timeout_s: float = Field(
        60.0,
        ge=0,
        description="a call of the engine process that runs longer than this is taken for a hung "
        "device: the engine exits (status 3, one error line), the supervisor replaces it and "
        "the workers send their "
        "batches again, once; 0: never",
    )
    max_worker_rss_mb: int = Field(
        0,
        ge=0,
        description="a worker whose resident memory passes this is replaced: the supervisor "
        "starts a new one, and once it is ready the old one stops accepting and finishes what "
        "it admitted; 0: never (docs/deploy.md sizes it)",
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="SIGTERM: time to finish admitted work")

    @field_validator("bundles")
    @classmethod
    def _bundles_exist(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(f"bundle directory {value} does not exist")
        return value

    @field_validator("root_task")
    @classmethod
    def _root_task(cls, value: str) -> str:
        from bertserve.runtime.tasks import TASKS

        if value not in TASKS:
            raise ValueError(f"BERTSERVE_ROOT_TASK must be one of {sorted(TASKS)}, got {value!r}")
        return value

    @field_validator("providers")
    @classmethod
    def _known_providers(cls, value: str) -> str:
        if value != "auto":
            unknown = [p for p in value.split(",") if p not in KNOWN_PROVIDERS]
            if unknown:
                raise ValueError(f"unknown providers {unknown}; use 'auto' or {KNOWN_PROVIDERS}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.max_batch_tokens < self.max_batch_rows:
            raise ValueError("max_batch_tokens must be at least max_batch_rows")
        try:
            tenants = self.tenants
        except KeysFileError as exc:
            raise ValueError(f"BERTSERVE_KEYS_FILE: {exc}") from None
        listed = {key for key, tenant in tenants.pairs if tenant is not DEFAULT}
        if any(key in listed for key in split_keys(self.api_key, self.api_keys)):
            raise ValueError("a key of BERTSERVE_API_KEYS is also in BERTSERVE_KEYS_FILE")
        tokens = [*tenants.keys, *self.admin_key_set()]
        if self.metrics_token is not None:
            tokens.append(self.metrics_token.get_secret_value().encode())
        short = [k for k in tokens if len(k) < MIN_KEY_LENGTH]
        if short:
            raise ValueError(
                f"an API key has {len(short[0])} characters; use at least {MIN_KEY_LENGTH} "
                "(python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        if self.model_memory_mb and self.model_control != "explicit":
            raise ValueError("model_memory_mb needs model_control=explicit")
        if self.load_at_start and self.model_control != "explicit":
            raise ValueError("load_at_start needs model_control=explicit")
        if self.model_control == "explicit" and self.engine_process:
            raise ValueError(
                "model_control=explicit does not run with engine_process yet: the engine "
                "process loads its models once, at start"
            )
        return self

    def admin_key_set(self) -> tuple[bytes, ...]:
        """The management API's keys (BERTSERVE_ADMIN_KEYS); empty: the API is off."""
        return split_keys(self.admin_keys)

    def start_models(self) -> tuple[str, ...] | None:
        """The bundle names loaded at start; None: every one (static control, or '*')."""
        if self.model_control == "static" or self.load_at_start.strip() == "*":
            return None
        return tuple(n.strip() for n in self.load_at_start.split(",") if n.strip())

    def keys(self) -> tuple[bytes, ...]:
        """Every accepted API key (BERTSERVE_API_KEY, BERTSERVE_API_KEYS and the keys file's)."""
        return self.tenants.keys

    @functools.cached_property
    def tenants(self) -> Tenants:
        """Every accepted key's tenant (service.tenants): the keys file's, then `default`."""
        pairs = read_keys_file(self.keys_file, MIN_KEY_LENGTH) if self.keys_file else []
        pairs += [(key, DEFAULT) for key in split_keys(self.api_key, self.api_keys)]
        return Tenants(pairs)

    @functools.cached_property
    def request_limits(self) -> RequestLimits:
        """The limits of one request, as the tasks name them."""
        return RequestLimits(
            max_client_batch=self.max_client_batch,
            max_request_rows=self.max_request_rows,
            max_rerank_documents=self.max_rerank_documents,
        )

    @property
    def worker_count(self) -> int:
        return self.workers or available_cores()

    @property
    def threads(self) -> int:
        return self.intra_op_threads or max(1, available_cores() // self.worker_count)

    def engine_options(self, device: bool = False) -> EngineOptions:
        """ONNX Runtime options of a worker's sessions, or (`device`) of the engine process's."""
        threads = (self.engine_threads or available_cores()) if device else self.threads
        return EngineOptions(
            providers=self.providers,
            threads=threads,
            spinning=self.intra_op_spinning,
            spin_stop=self.intra_op_spin_stop,
            lone_threads=0 if device else (self.lone_threads or self.worker_count * self.threads),
            require_gpu=self.require_gpu,
            device_id=self.device_id,
            gpu_mem_limit=self.gpu_mem_limit,
            arena_extend_strategy=self.arena_extend_strategy,
            cpu_arena=self.cpu_arena,
            cudnn_conv_algo_search=self.cudnn_conv_algo_search,
            use_tf32=self.use_tf32,
            engine=self.engine,
            openvino_precision=self.openvino_precision,
        )


# --- the command line and the docs' table, both from the fields above -------------------------


def env_name(name: str) -> str:
    return "BERTSERVE_" + name.upper()


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def is_secret(name: str) -> bool:
    """Keys and tokens are read from the environment only: on a command line every user of the
    machine sees them (`ps`)."""
    return SecretStr in get_args(Settings.model_fields[name].annotation)


def default_text(name: str) -> str:
    default = Settings.model_fields[name].default
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag a setting, in its group, its help the field's description; keys and tokens are
    listed under their environment variable only. Each flag's default is "not given", so the
    environment, then the field's default, apply (flags win)."""
    for group, names in GROUPS.items():
        secrets = [env_name(n) for n in names if is_secret(n)]
        note = f"environment only: {', '.join(secrets)}" if secrets else None
        section = parser.add_argument_group(group, note)
        for name in names:
            field = Settings.model_fields[name]
            if is_secret(name):
                continue
            help_text = f"{field.description} [{env_name(name)}; default {default_text(name)}]"
            kind = field.annotation
            if get_origin(kind) is types.UnionType:  # `int | None`: the flag takes an int
                kind = next(a for a in get_args(kind) if a is not type(None))
            options: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text}
            if kind is bool:
                options["action"] = argparse.BooleanOptionalAction
            elif get_origin(kind) is Literal:
                options["choices"] = get_args(kind)
            else:
                options["type"] = kind
                options["metavar"] = name.split("_")[-1].upper()
            section.add_argument(flag_of(name), dest=name, **options)


def settings_table() -> str:
    """docs/api.md's settings table (tools/docs.py writes it; a test holds it equal)."""
    lines: list[str] = []
    for group, names in GROUPS.items():
        lines += [f"**{group.capitalize()}**", "", "| Variable | Flag | Default | Meaning |"]
        lines.append("|---|---|---|---|")
        for name in names:
            field = Settings.model_fields[name]
            flag = "(environment only)" if is_secret(name) else f"`{flag_of(name)}`"
            meaning = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{env_name(name)}` | {flag} | `{default_text(name)}` | {meaning} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
