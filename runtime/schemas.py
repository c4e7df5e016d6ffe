"""What every task's schema shares (Hugging Face Inference API conventions: `inputs` is one item
or a list, `parameters` holds the task's options), and the error body. Each task's own request
and response models live in its module under runtime/tasks/."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

# What the service enforces, written into the OpenAPI schema so clients (and fuzzers) see it.


def _whole(value: object) -> object:
    """JSON Schema's integer: 5.0 is one (and JSON decoders make it a float); 5.5 is not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer field of a request: strict (no "5", no true), but 5.0 counts, as JSON Schema says.
# Bounds go before WHOLE inside one Annotated (`Annotated[int, Field(ge=1), WHOLE]`), or on the
# field itself: nested in another Annotated they would not reach the JSON schema.
WHOLE = BeforeValidator(_whole)
Int = Annotated[int, WHOLE]
Text = Annotated[str, Field(min_length=1, pattern=r"\S", description="not empty or blank")]
# Request priorities, lowest and highest number: lower is served first, as Cohere's and vLLM's
# `priority` (0, the default of a request of one input, is the most urgent): runtime.batching.
PRIORITIES = (0, 999)
Priority = Annotated[int, Field(ge=PRIORITIES[0], le=PRIORITIES[1]), WHOLE] | None
PRIORITY_TEXT = (
    "lower is served first (0: the default of a request of one input; a client batch's is "
    "BERTSERVE_BULK_PRIORITY); a queued request rises a level every BERTSERVE_PRIORITY_AGING_S"
)


# Strict types: a JSON value of another type is refused (no "true" for a boolean, no 1.0 for an
# integer), so the OpenAPI document is the whole contract for every field it declares. Fields it
# does not declare are ignored, as text-embeddings-inference and the Hugging Face Inference API
# ignore them: clients send their own (langchain, haystack, litellm, huggingface_hub each add
# some), and a 422 for a field nobody here reads breaks them for nothing. The one schema whose
# owner refuses unknown fields, OpenAI's, refuses them too (`CLOSED`). docs/api.md#client-libraries
# lists what each client sends, and which of it is honoured.
STRICT = ConfigDict(extra="ignore", strict=True)
CLOSED = ConfigDict(extra="forbid", strict=True)


class Request(BaseModel):
    model_config = STRICT


class Params(BaseModel):
    """A task's options. Frozen: a request that leaves them out shares the default instance,
    which pydantic then need not deep-copy on every request (8.4 -> 1.4 us a validation)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class ErrorBody(BaseModel):
    error: str
    error_type: str
