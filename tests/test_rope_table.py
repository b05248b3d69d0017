"""A step's rotary embedding as rows of the model's table of positions (MoEModel.rope): the floats
of the step's positions computed alone, whatever the table's size when the step reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowmoe.kernels.layout import TokenLayout
from flowmoe.kernels.rope import Rotary
from flowmoe.model.loading import load_model
from flowmoe.model.moe_model import ROPE_TABLE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_steps_rope_is_its_positions_alone(mixtral_folder: Path, dtype: str) -> None:
    model = load_model(mixtral_folder, dtype)
    steps = [  # (slots, counts, past): a prefill, decode steps, one past the first table, a batch
        ((0,), (5,), (0,)),
        ((0,), (1,), (ROPE_TABLE - 1,)),
        ((0,), (1,), (ROPE_TABLE,)),
        ((1, 0), (1, 3), (7, 2 * ROPE_TABLE + 9)),
        ((0,), (1,), (3,)),
    ]
    sizes = []
    for slots, counts, past in steps:
        layout = TokenLayout(slots, counts, past)
        got = model.rope(layout)
        want = Rotary.at(model.inv_freq, model.rope_scaling, layout.positions, model.dtype)
        assert got.cos.shape == want.cos.shape == (sum(counts), 1, want.cos.shape[-1])
        assert torch.equal(got.cos, want.cos) and torch.equal(got.signed_sin, want.signed_sin)
        (table,) = model._rope_tables.values()
        sizes.append(table.cos.shape[0])
    # grown to the next power of two a step reaches, never shrunk
    assert sizes == [ROPE_TABLE, ROPE_TABLE, 2 * ROPE_TABLE, 4 * ROPE_TABLE, 4 * ROPE_TABLE]
