from __future__ import annotations

import pytest
import torch


@pytest.fixture
def padded_batch() -> dict[str, torch.Tensor]:
    """Three rows of lengths 7, 4 and 1, right-padded with id 0; pair segments on row 0."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 99, (3, 7), generator=g)
    attention_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] + [0] * 6])
    input_ids = input_ids * attention_mask
    token_type_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0] * 7, [0] * 7])
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
    }
