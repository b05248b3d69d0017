"""cpu_rope.c's rotary embedding against rope.py's torch form (x * cos + x.roll(R / 2) * signed_sin):
the same floats bit for bit, fp32 and bf16, strided query/key views of a fused projection, one
token and many; and what it leaves to torch."""

from __future__ import annotations

import pytest
import torch

from flowmoe.kernels import cpu_rope
from flowmoe.kernels.rope import Rotary

compiled = pytest.mark.skipif(cpu_rope.kernel() is None, reason="no C kernels on this host")


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("dim", [16, 64])
def test_rotate_is_the_torch_form_bit_for_bit(dtype: torch.dtype, tokens: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(tokens * dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    rotary = Rotary.at(inv_freq, 1.0, torch.randint(0, 4096, (tokens,), generator=generator), dtype)
    heads = (torch.randn(tokens, 12, dim, generator=generator) * 5).to(dtype)  # q, k and v heads
    qk = heads[:, :10]  # a strided view, as pre_attention's
    tables = cpu_rope.tables(rotary.cos, rotary.signed_sin)
    assert tables is not None
    want = qk * rotary.cos + qk.roll(dim // 2, dims=-1) * rotary.signed_sin
    out = cpu_rope.rotated(qk, tables)
    assert out is not None and torch.equal(out, want)
    assert torch.equal(rotary(qk), want)


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("rotated", [64, 32])  # every dim, and a partial rotary
def test_rotate_in_place_is_the_torch_form_bit_for_bit(dtype: torch.dtype, tokens: int, rotated: int) -> None:
    """pre_attention's q and k heads rotated in place in the fused projection, v's left as they are."""
    generator = torch.Generator().manual_seed(tokens * rotated)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotated, 2).float() / rotated))
    rotary = Rotary.at(inv_freq, 1.0, torch.randint(0, 4096, (tokens,), generator=generator), dtype)
    heads = (torch.randn(tokens, 12, 64, generator=generator) * 5).to(dtype)  # q, k and v heads
    want = heads.clone()
    want[:, :10] = rotary(heads[:, :10])
    assert rotary.rotate_(heads, 10)
    assert torch.equal(heads, want)


def test_what_it_leaves_to_torch() -> None:
    rotary = Rotary.at(torch.ones(8), 1.0, torch.arange(3), torch.float32)
    x = torch.randn(3, 4, 16)
    tables = cpu_rope.tables(rotary.cos, rotary.signed_sin)
    assert tables is not None
    assert cpu_rope.rotated(x.bfloat16(), tables) is None  # dtypes differ
    assert cpu_rope.tables(rotary.cos.half(), rotary.signed_sin.half()) is None
    assert cpu_rope.tables(rotary.cos[..., :8], rotary.signed_sin[..., :8]) is None  # strided tables
    assert cpu_rope.rotated(torch.randn(3, 4, 32)[..., ::2], tables) is None  # strided dims
    assert not cpu_rope.rotate_(x.bfloat16(), 4, tables)
    assert not cpu_rope.rotate_(x[:, :, :8], 4, tables)  # fewer dims than rotated
    assert cpu_rope.rotated(x.requires_grad_(), tables) is None
    assert not cpu_rope.rotate_(x, 4, tables)
