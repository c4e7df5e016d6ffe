"""What every task's schema shares (Hugging Face Inference API conventions: `inputs` is one item
or a list, `parameters` holds the task's options), and the error body. Each task's own request
and response models live in its module under runtime/tasks/."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# What the service enforces, written into the OpenAPI schema so clients (and fuzzers) see it.
Text = Annotated[str, Field(min_length=1, pattern=r"\S", description="not empty or blank")]


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Params(BaseModel):
    """A task's options. Frozen: a request that leaves them out shares the default instance,
    which pydantic then need not deep-copy on every request (8.4 -> 1.4 us a validation)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ErrorBody(BaseModel):
    error: str
    error_type: str
