"""Each side of attention's host kernels in one C call (kernels/cpu_attention_ends.py): the floats of
the separate calls (norm, projection and rope before; projection, residual add and norm after), and
a model's layers the same with the fused calls on and off."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flowmoe.kernels import cpu_attention_ends as ends
from flowmoe.kernels import cpu_expert, cpu_norm
from flowmoe.kernels.layout import TokenLayout
from flowmoe.kernels.rope import Rotary
from flowmoe.model.loading import load_model

pytestmark = pytest.mark.skipif(ends.pre_kernel() is None, reason="no C compiler: the kernels are off")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 96, 4, 2, 16  # [T, 96] -> qkv [T, (4 + 2 * 2) * 16]


def _rope(rows: int, rotary: int, dtype: torch.dtype) -> Rotary:
    inv = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
    return Rotary.at(inv, 1.0, torch.arange(rows) + 7, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(("bias", "rotary"), [(False, HEAD_DIM), (True, HEAD_DIM), (False, HEAD_DIM // 2)])
def test_pre_attention_is_the_three_calls(dtype: torch.dtype, rows: int, bias: bool, rotary: int) -> None:
    torch.manual_seed(rows)
    hidden = torch.randn(rows, HIDDEN).to(dtype)
    norm = (1 + 0.1 * torch.randn(HIDDEN)).to(dtype)
    outs = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    weight = (0.1 * torch.randn(outs, HIDDEN)).to(dtype)
    qkv_bias = torch.randn(outs).to(dtype) if bias else None
    rope = _rope(rows, rotary, dtype)
    fused = ends.pre_attention(hidden, norm, 1e-5, weight, qkv_bias, rope, HEADS + KV_HEADS, HEAD_DIM)
    assert fused is not None and fused.shape == (rows, outs) and fused.dtype == dtype
    normed = cpu_norm.normed(hidden, None, norm, 1e-5)
    assert normed is not None
    separate = cpu_expert.linear_rows(normed, weight, qkv_bias)
    assert rope.rotate_(separate.view(rows, HEADS + 2 * KV_HEADS, HEAD_DIM), HEADS + KV_HEADS)
    assert torch.equal(fused, separate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_post_attention_is_the_two_calls(dtype: torch.dtype, rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    attn = torch.randn(rows, HEADS * HEAD_DIM).to(dtype)
    weight = (0.1 * torch.randn(HIDDEN, HEADS * HEAD_DIM)).to(dtype)
    o_bias = torch.randn(HIDDEN).to(dtype) if bias else None
    residual = torch.randn(rows, HIDDEN).to(dtype)
    norm = (1 + 0.1 * torch.randn(HIDDEN)).to(dtype)
    both = ends.post_attention(attn, weight, o_bias, residual, norm, 1e-5)
    assert both is not None
    total = cpu_expert.linear_rows(attn, weight, o_bias)
    normed = cpu_norm.normed(total, residual, norm, 1e-5)  # total += residual first
    assert normed is not None
    assert torch.equal(both[0], total) and torch.equal(both[1], normed)


def test_where_a_kernel_would_not_take_its_part_none() -> None:
    hidden, norm = torch.randn(2, HIDDEN), torch.ones(HIDDEN)
    weight, rope = torch.randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), _rope(2, HEAD_DIM, torch.float32)
    assert (
        ends.pre_attention(hidden, norm, 1e-5, weight.bfloat16(), None, rope, HEADS + KV_HEADS, HEAD_DIM)
        is None
    )
    assert (
        ends.pre_attention(hidden, norm.bfloat16(), 1e-5, weight, None, rope, HEADS + KV_HEADS, HEAD_DIM)
        is None
    )
    other_rows = _rope(3, HEAD_DIM, torch.float32)  # a step's rope of other tokens
    assert (
        ends.pre_attention(hidden, norm, 1e-5, weight, None, other_rows, HEADS + KV_HEADS, HEAD_DIM) is None
    )
    attn = torch.randn(2, HEADS * HEAD_DIM)
    o = torch.randn(HIDDEN, HEADS * HEAD_DIM)
    assert ends.post_attention(attn, o, None, torch.randn(2, HIDDEN).bfloat16(), norm, 1e-5) is None
    assert ends.post_attention(attn, o, None, torch.randn(3, HIDDEN), norm, 1e-5) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_models_layer_is_the_same_with_the_calls_off(
    mixtral_folder: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    model = load_model(mixtral_folder, dtype)
    layout = TokenLayout((0, 1), (1, 2), (5, 9))
    rope = model.rope(layout)
    hidden = torch.randn(3, model.spec.hidden).to(model.dtype)
    attn = torch.randn(3, model.spec.attention.heads * model.spec.attention.head_dim).to(model.dtype)

    def both_sides() -> list[torch.Tensor]:
        q, k, v = model.pre_attention(1, hidden, rope)
        total, normed = model.post_attention(1, hidden, attn.clone())
        return [q, k, v, total, normed]

    fused = []
    for name in ("pre_attention", "post_attention"):
        real = getattr(ends, name)

        def counted(*args: object, _real: Callable[..., object] = real) -> object:
            out = _real(*args)
            fused.append(out is not None)
            return out

        monkeypatch.setattr(ends, name, counted)
    with torch.inference_mode():
        on = both_sides()
        assert fused == [True, True]  # both sides took their one call
        monkeypatch.setattr(ends, "pre_kernel", lambda: None)
        monkeypatch.setattr(ends, "post_kernel", lambda: None)
        off = both_sides()
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(on, off, strict=True))
