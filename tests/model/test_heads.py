"""Shapes of every head on a tiny config, BERT's init, tying, losses and padding invariance."""

from __future__ import annotations

import pytest
import torch

from bertserve.model.bert import BertModel
from bertserve.model.heads import (
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)


def test_encoder_shapes(tiny_config, padded_batch):
    model = BertModel(tiny_config).eval()
    sequence, pooled = model(**padded_batch)
    assert sequence.shape == (3, 7, 32)
    assert pooled.shape == (3, 32)
    assert BertModel(tiny_config, add_pooling_layer=False)(**padded_batch)[1] is None


def test_every_head_shape(tiny_config, padded_batch):
    torch.manual_seed(0)
    out = BertForPreTraining(tiny_config).eval()(**padded_batch)
    assert out.mlm_logits.shape == (3, 7, 99)
    assert out.nsp_logits.shape == (3, 2)
    assert BertForSequenceClassification(tiny_config)(**padded_batch).logits.shape == (3, 3)
    assert BertForTokenClassification(tiny_config)(**padded_batch).logits.shape == (3, 7, 3)
    span = BertForQuestionAnswering(tiny_config)(**padded_batch)
    assert span.start_logits.shape == span.end_logits.shape == (3, 7)


def test_mlm_scores_only_the_given_positions(tiny_config, padded_batch):
    model = BertForPreTraining(tiny_config).eval()
    positions = torch.tensor([[1, 3], [2, 0], [0, 0]])
    sparse = model(**padded_batch, mlm_positions=positions).mlm_logits
    full = model(**padded_batch).mlm_logits
    assert sparse.shape == (3, 2, 99)
    expected = torch.stack([full[b, positions[b]] for b in range(3)])
    torch.testing.assert_close(sparse, expected)


def test_decoder_is_tied_to_word_embeddings(tiny_config):
    model = BertForPreTraining(tiny_config)
    decoder = model.cls.predictions.decoder.weight
    assert decoder is model.bert.embeddings.word_embeddings.weight
    names = [n for n, _ in model.named_parameters()]
    assert "cls.predictions.decoder.weight" not in names  # one tensor, counted once
    assert "cls.predictions.bias" in names


def test_bert_initialisation(tiny_config):
    torch.manual_seed(0)
    model = BertForPreTraining(
        tiny_config.replace(
            hidden_size=256, num_attention_heads=4, intermediate_size=512, vocab_size=3000
        )
    )
    q = model.bert.encoder.layer[0].attention.self.query
    assert abs(q.weight.std().item() - 0.02) < 0.002
    assert torch.count_nonzero(q.bias) == 0
    ln = model.bert.encoder.layer[0].output.LayerNorm
    assert torch.all(ln.weight == 1) and torch.all(ln.bias == 0)
    assert torch.count_nonzero(model.bert.embeddings.word_embeddings.weight[0]) == 0  # [PAD] row


def test_losses_ignore_minus_100(tiny_config, padded_batch):
    torch.manual_seed(0)
    model = BertForTokenClassification(tiny_config).eval()
    labels = torch.full((3, 7), -100)
    labels[0, 1], labels[1, 2] = 1, 2
    out = model(**padded_batch, labels=labels)
    logits = out.logits
    expected = torch.nn.functional.cross_entropy(
        torch.stack([logits[0, 1], logits[1, 2]]), torch.tensor([1, 2])
    )
    torch.testing.assert_close(out.loss, expected)

    pre = BertForPreTraining(tiny_config).eval()
    positions = torch.tensor([[1, 2], [1, 0], [0, 0]])
    mlm_labels = torch.tensor([[7, 8], [9, -100], [-100, -100]])
    res = pre(
        **padded_batch,
        mlm_positions=positions,
        mlm_labels=mlm_labels,
        next_sentence_label=torch.tensor([0, 1, 0]),
    )
    torch.testing.assert_close(res.loss, res.mlm_loss + res.nsp_loss)
    logp = torch.log_softmax(res.mlm_logits, -1)
    manual = -(logp[0, 0, 7] + logp[0, 1, 8] + logp[1, 0, 9]) / 3
    torch.testing.assert_close(res.mlm_loss, manual)

    qa = BertForQuestionAnswering(tiny_config).eval()
    span = qa(
        **padded_batch,
        start_positions=torch.tensor([1, 2, -100]),
        end_positions=torch.tensor([3, 2, -100]),
    )
    assert torch.isfinite(span.loss)


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_padding_invariance(tiny_config, padded_batch, act):
    """A sequence's outputs at its valid positions do not depend on padding or batch-mates."""
    torch.manual_seed(0)
    model = BertForPreTraining(tiny_config.replace(hidden_act=act)).eval()
    batched = model(**padded_batch)
    for row, length in enumerate([7, 4, 1]):
        alone = model(**{k: v[row : row + 1, :length] for k, v in padded_batch.items()})
        torch.testing.assert_close(
            batched.mlm_logits[row, :length], alone.mlm_logits[0], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            batched.nsp_logits[row], alone.nsp_logits[0], atol=1e-5, rtol=1e-5
        )


def test_exact_and_tanh_gelu_differ(tiny_config, padded_batch):
    torch.manual_seed(0)
    exact = BertForSequenceClassification(tiny_config).eval()
    tanh = BertForSequenceClassification(tiny_config.replace(hidden_act="gelu_new")).eval()
    tanh.load_state_dict(exact.state_dict())
    a, b = exact(**padded_batch).logits, tanh(**padded_batch).logits
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b, atol=1e-2, rtol=0)


def test_classification_heads_need_labels(tiny_config):
    with pytest.raises(ValueError, match="needs id2label"):
        BertForSequenceClassification(tiny_config.replace(id2label=None, label2id=None))
