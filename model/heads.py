"""Task heads on the BERT encoder, each a complete model with Hugging Face's class and key names.

| class                         | head keys (BERT's names)              | output              |
|-------------------------------|---------------------------------------|---------------------|
| BertEncoderModel (BertModel)  | none                                  | hidden states, pooled |
| BertForPreTraining            | cls.predictions, cls.seq_relationship | MLM, NSP logits     |
| BertForMaskedLM               | cls.predictions                       | MLM logits          |
| BertForSequenceClassification | classifier (on the pooler)            | (B, num_labels)     |
| BertForTokenClassification    | classifier (on every position)        | (B, S, num_labels)  |
| BertForQuestionAnswering      | qa_outputs                            | start/end (B, S)    |
| BertForReplacedTokenDetection | discriminator_predictions (ELECTRA)   | (B, S)              |

The other families' checkpoints name them their way (RobertaForSequenceClassification's
`classifier.dense` is our pooler): model/families.py translates.

Every loss ignores label -100. The MLM decoder's weight *is* the word-embedding matrix (one
tensor), with its own vocabulary bias, and it can score only the positions it is given, so
pre-training and fill-mask never pay for vocabulary logits at positions nobody asked about.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bertserve.model.bert import BertModel, activation, init_weights
from bertserve.model.config import BertConfig

IGNORE_INDEX = -100


class BertPredictionHeadTransform(nn.Module):
    """dense, activation, LayerNorm: into the word embeddings' width (ELECTRA's is narrower)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.embedding_width)
        self.transform_act_fn = activation(config.hidden_act)
        self.LayerNorm = nn.LayerNorm(config.embedding_width, eps=config.layer_norm_eps)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.embedding_width, config.vocab_size, bias=False)  # tied
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.transform(hidden)) + self.bias  # (..., V)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)  # 0 = B follows A


def gather_positions(sequence_output: Tensor, positions: Tensor) -> Tensor:
    """(B, S, H) and (B, P) indices -> (B, P, H): the hidden states at the given positions."""
    index = positions.unsqueeze(-1).expand(-1, -1, sequence_output.shape[-1])
    return torch.gather(sequence_output, 1, index)


def splade_pool(
    logits: Tensor, attention_mask: Tensor, pooling: str = "max", activation: str = "relu"
) -> Tensor:
    """SPLADE's sparse vector, (B, S, V) MLM logits -> (B, V), as sentence-transformers'
    SpladePooling computes it: log(1 + ReLU(logits)) (`activation` "log1p_relu": log1p once
    more) at the text's positions, then their max (or sum). A padded position's logits are
    zeroed first, which ReLU keeps at 0. For max pooling the transform is monotonic, so the max
    is taken first and the transform runs on (B, V), not on every position's (S, V)."""
    masked = logits * attention_mask.unsqueeze(-1).to(logits.dtype)  # (B, S, V)
    if pooling == "max":
        pooled = torch.log1p(torch.relu(masked.max(dim=1).values))  # (B, V)
        return torch.log1p(pooled) if activation == "log1p_relu" else pooled
    weights = torch.log1p(torch.relu(masked))
    if activation == "log1p_relu":
        weights = torch.log1p(weights)
    return weights.sum(dim=1)


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


class BertPreTrainedModel(nn.Module):
    """Shared by every head: the config, BERT's initialisation, and the task's label check.
    `architecture` is the Hugging Face class name written into config.json."""

    needs_labels = False
    architecture = ""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if self.needs_labels and config.num_labels < 1:
            raise ValueError(
                f"{type(self).__name__} needs id2label in its config (no labels given)"
            )
        self.config = config

    def init_weights(self) -> None:
        self.apply(lambda module: init_weights(module, self.config.initializer_range))
        self.tie_weights()

    def tie_weights(self) -> None:
        """Heads with tied parameters re-point them after init or loading."""


class BertEncoderModel(BertPreTrainedModel):
    """The bare encoder (Hugging Face's `BertModel`): sequence output and pooled output."""

    architecture = "BertModel"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=config.family.pooler)
        self.init_weights()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        return self.bert(input_ids, attention_mask, token_type_ids)  # (B, S, H), (B, H)


@dataclass
class PreTrainingOutput:
    mlm_logits: Tensor  # (B, P, V) at the given positions, or (B, S, V) if none were given
    nsp_logits: Tensor  # (B, 2); class 0 = is next
    loss: Tensor | None = None
    mlm_loss: Tensor | None = None
    nsp_loss: Tensor | None = None


class BertForPreTraining(BertPreTrainedModel):
    architecture = "BertForPreTraining"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.init_weights()

    def tie_weights(self) -> None:
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(
        self,
        input_ids: Tensor,  # (B, S)
        attention_mask: Tensor | None = None,  # (B, S)
        token_type_ids: Tensor | None = None,  # (B, S)
        mlm_positions: Tensor | None = None,  # (B, P): score only these positions
        mlm_labels: Tensor | None = None,  # (B, P) or (B, S) target ids, -100 = ignore
        next_sentence_label: Tensor | None = None,  # (B,) 0 = is next, 1 = random
    ) -> PreTrainingOutput:
        sequence_output, pooled = self.bert(input_ids, attention_mask, token_type_ids)
        if mlm_positions is not None:
            sequence_output = gather_positions(sequence_output, mlm_positions)
        out = PreTrainingOutput(
            mlm_logits=self.cls.predictions(sequence_output),
            nsp_logits=self.cls.seq_relationship(pooled),
        )
        if mlm_labels is not None:
            out.mlm_loss = cross_entropy(out.mlm_logits, mlm_labels)
        if next_sentence_label is not None:
            out.nsp_loss = cross_entropy(out.nsp_logits, next_sentence_label)
        losses = [x for x in (out.mlm_loss, out.nsp_loss) if x is not None]
        if losses:
            out.loss = sum(losses[1:], losses[0])
        return out


@dataclass
class ClassifierOutput:
    logits: Tensor  # (B, num_labels) or (B, S, num_labels)
    loss: Tensor | None = None


class BertForMaskedLM(BertPreTrainedModel):
    """The MLM head alone (no NSP): the fill-mask model of every family (RobertaForMaskedLM,
    DistilBertForMaskedLM, ElectraForMaskedLM, BertForMaskedLM)."""

    architecture = "BertForMaskedLM"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.init_weights()

    def tie_weights(self) -> None:
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(
        self,
        input_ids: Tensor,  # (B, S)
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        mlm_positions: Tensor | None = None,  # (B, P): score only these positions
        labels: Tensor | None = None,  # (B, P) or (B, S), -100 = ignore
    ) -> ClassifierOutput:
        sequence_output, _ = self.bert(input_ids, attention_mask, token_type_ids)
        if mlm_positions is not None:
            sequence_output = gather_positions(sequence_output, mlm_positions)
        logits = self.cls.predictions(sequence_output)  # (B, P or S, V)
        return ClassifierOutput(logits, None if labels is None else cross_entropy(logits, labels))


class ElectraDiscriminatorPredictions(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = activation(config.hidden_act)
        self.dense_prediction = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.dense_prediction(self.activation(self.dense(hidden))).squeeze(-1)  # (B, S)


class BertForReplacedTokenDetection(BertPreTrainedModel):
    """ELECTRA's discriminator (Hugging Face's ElectraForPreTraining): one logit a token, > 0
    for a token the generator replaced. Most published ELECTRA checkpoints are this one."""

    architecture = "BertForReplacedTokenDetection"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.discriminator_predictions = ElectraDiscriminatorPredictions(config)
        self.init_weights()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> ClassifierOutput:
        sequence_output, _ = self.bert(input_ids, attention_mask, token_type_ids)
        return ClassifierOutput(self.discriminator_predictions(sequence_output))


class _BertClassifier(BertPreTrainedModel):
    """Dropout + one linear layer over the pooler (one label a sequence) or over every position
    (one label a token): the two classification heads differ only in what they read."""

    needs_labels = True
    per_token = False

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=not self.per_token)
        dropout = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,  # (B,) or, per token, (B, S) with -100 where ignored
    ) -> ClassifierOutput:
        sequence_output, pooled = self.bert(input_ids, attention_mask, token_type_ids)
        features = sequence_output if self.per_token else pooled  # (B, S, H) or (B, H)
        logits = self.classifier(self.dropout(features))  # (B, [S,] num_labels)
        return ClassifierOutput(logits, None if labels is None else cross_entropy(logits, labels))


class BertForSequenceClassification(_BertClassifier):
    architecture = "BertForSequenceClassification"


class BertForTokenClassification(_BertClassifier):
    """Labels: the first word piece of each word; -100 on later pieces, specials and padding."""

    architecture = "BertForTokenClassification"
    per_token = True


@dataclass
class SpanOutput:
    start_logits: Tensor  # (B, S)
    end_logits: Tensor  # (B, S)
    loss: Tensor | None = None


class BertForQuestionAnswering(BertPreTrainedModel):
    architecture = "BertForQuestionAnswering"

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        start_positions: Tensor | None = None,  # (B,) token index; 0 ([CLS]) = not in window
        end_positions: Tensor | None = None,  # (B,)
    ) -> SpanOutput:
        sequence_output, _ = self.bert(input_ids, attention_mask, token_type_ids)
        start_logits, end_logits = self.qa_outputs(sequence_output).unbind(-1)  # 2 x (B, S)
        out = SpanOutput(start_logits, end_logits)
        if start_positions is not None and end_positions is not None:
            out.loss = (
                cross_entropy(start_logits, start_positions)
                + cross_entropy(end_logits, end_positions)
            ) / 2
        return out


HEADS: dict[str, type[BertPreTrainedModel]] = {
    cls.architecture: cls
    for cls in (
        BertEncoderModel,
        BertForPreTraining,
        BertForMaskedLM,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertForQuestionAnswering,
        BertForReplacedTokenDetection,
    )
}
