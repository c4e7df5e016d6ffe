from __future__ import annotations

import json

import pytest

from bertserve.model.config import BertConfig


def test_round_trip_through_config_json(tmp_path, tiny_config):
    path = tmp_path / "config.json"
    tiny_config.to_json_file(path)
    data = json.loads(path.read_text())
    assert data["model_type"] == "bert"
    assert data["id2label"] == {"0": "NEG", "1": "POS", "2": "NEU"}
    assert BertConfig.from_json_file(path) == tiny_config


def test_label2id_is_derived_and_checked():
    config = BertConfig(id2label={"0": "a", "1": "b"})
    assert config.id2label == {0: "a", 1: "b"}
    assert config.label2id == {"a": 0, "b": 1}
    assert config.num_labels == 2
    with pytest.raises(ValueError, match="does not invert"):
        BertConfig(id2label={0: "a", 1: "b"}, label2id={"a": 1, "b": 0})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 30, "num_attention_heads": 4}, "not divisible by num_attention_heads 4"),
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"vocab_size": 0}, "vocab_size must be a positive int"),
        ({"pad_token_id": 40000}, "pad_token_id 40000 is outside"),
        ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob must be in"),
        ({"id2label": {0: "a", 2: "b"}}, "ids must be 0..n-1"),
    ],
)
def test_invalid_configs_name_the_problem(changes, message):
    with pytest.raises(ValueError, match=message):
        BertConfig(**changes)


def test_hugging_face_extras_are_accepted_and_semantic_ones_checked():
    data = {
        "model_type": "bert",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "transformers_version": "4.57.6",
        "use_cache": True,
        "gradient_checkpointing": False,
        "position_embedding_type": "absolute",
    }
    assert BertConfig.from_dict(data).hidden_size == 64
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        BertConfig.from_dict({**data, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="model_type 'mpnet'; supported: bert, distilbert"):
        BertConfig.from_dict({**data, "model_type": "mpnet"})


def test_config_is_frozen(tiny_config):
    with pytest.raises(AttributeError):
        tiny_config.hidden_size = 64  # type: ignore[misc]
    assert tiny_config.replace(hidden_size=64, num_attention_heads=4).hidden_size == 64


def test_the_case_schemes_segment_counts_agree_with_the_runtime():
    """model/config.py checks a config's segment table against CASE_SEGMENTS; the runtime
    computes the ids: the two must say the same of every scheme."""
    from bertserve.model.config import CASE_SEGMENTS
    from bertserve.runtime.encoding import CASE_SCHEMES, case_type_vocab

    assert set(CASE_SEGMENTS) == set(CASE_SCHEMES)
    assert all(case_type_vocab(s) == n for s, n in CASE_SEGMENTS.items())
