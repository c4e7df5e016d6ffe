"""Request and response models (Hugging Face Inference API conventions): `inputs` is one item or
a list, `parameters` holds the task's options."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# What the service enforces, written into the OpenAPI schema so clients (and fuzzers) see it.
Text = Annotated[str, Field(min_length=1, pattern=r"\S", description="not empty or blank")]
MaskedText = Annotated[
    str, Field(min_length=6, pattern=r"\[MASK\]", description="contains at least one [MASK]")
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FillMaskParams(_Params):
    top_k: int = Field(5, ge=1, le=100)
    targets: list[str] | None = Field(None, min_length=1, max_length=1000)
    truncation: bool = False


class FillMaskRequest(_Request):
    inputs: MaskedText | Annotated[list[MaskedText], Field(min_length=1)]
    parameters: FillMaskParams = FillMaskParams()


class ClassifyParams(_Params):
    top_k: int | None = Field(1, ge=1, description="labels per input; null for all")
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = None
    truncation: bool = False


class ClassifyRequest(_Request):
    inputs: Text | Annotated[list[Text], Field(min_length=1)]
    parameters: ClassifyParams = ClassifyParams()


class NerParams(_Params):
    # "first": an entity word takes its first piece's label, the piece the model is trained to
    # label (model.training.data.tasks.align_labels). "simple" groups pieces by their own
    # labels, and the untrained labels of later pieces split words ("Leices" ORG, "##tershire"
    # PER): 21.5 entity F1 against 58 with "first" on the same tiny bundle.
    aggregation_strategy: Literal["none", "simple", "first", "average", "max"] = "first"
    ignore_labels: list[str] = ["O"]
    stride: int = Field(32, ge=0, description="overlap of windows over a long text, in tokens")


class NerRequest(_Request):
    inputs: Text | Annotated[list[Text], Field(min_length=1)]
    parameters: NerParams = NerParams()


class QaInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: Text
    context: Text


class QaParams(_Params):
    top_k: int = Field(1, ge=1, le=100)
    doc_stride: int = Field(128, ge=0)
    max_answer_len: int = Field(15, ge=1)
    max_seq_len: int = Field(384, ge=16)
    max_question_len: int = Field(64, ge=1)
    handle_impossible_answer: bool = False


class QaRequest(_Request):
    inputs: QaInput | Annotated[list[QaInput], Field(min_length=1)]
    parameters: QaParams = QaParams()


class NspInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text
    text_pair: Text


class NspParams(_Params):
    truncation: bool = False


class NspRequest(_Request):
    inputs: NspInput | Annotated[list[NspInput], Field(min_length=1)]
    parameters: NspParams = NspParams()


class LabelScore(BaseModel):
    label: str
    score: float


class FillMaskItem(BaseModel):
    score: float
    token: int
    token_str: str
    sequence: str


class Entity(BaseModel):
    entity_group: str | None = None
    entity: str | None = None
    index: int | None = None
    score: float
    word: str
    start: int
    end: int


class Answer(BaseModel):
    answer: str
    score: float
    start: int
    end: int


class NspResult(BaseModel):
    is_next: bool
    score: float = Field(description="probability that text_pair follows text")


class ErrorBody(BaseModel):
    error: str
    error_type: str
