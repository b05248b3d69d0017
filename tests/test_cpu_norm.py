"""cpu_norm.c's RMSNorm against torch's composite (Hugging Face's float32 RMSNorm): the same floats
bit for bit, for row widths narrower than a vector, with vector tails and past the 2^4-step cascade
levels of torch's sum, fp32 and bf16, one row and many; and what it leaves to torch."""

from __future__ import annotations

import pytest
import torch

from flowmoe.kernels import cpu_norm, native

compiled = pytest.mark.skipif(cpu_norm.kernel() is None, reason="no C kernels on this host")


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """cpu_norm.normed of x without a residual, which must take it."""
    out = cpu_norm.normed(x, None, weight, eps)
    assert out is not None
    return out


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 7, 31, 96, 100, 1024, 2880, 7168])
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm_is_torchs_composite_bit_for_bit(dtype: torch.dtype, dim: int, rows: int) -> None:
    generator = torch.Generator().manual_seed(dim * 100 + rows)
    scale = torch.rand(rows, 1, generator=generator) * 10  # rows of different magnitudes
    x = (torch.randn(rows, dim, generator=generator) * scale).to(dtype)
    weight = torch.randn(dim, generator=generator).to(dtype)
    assert torch.equal(_normed(x, weight, 1e-6), _reference(x, weight, 1e-6))
    many = x.reshape(1, rows, dim)  # [..., dim] rows in any shape
    assert torch.equal(_normed(many, weight, 1e-5), _reference(many, weight, 1e-5))


@compiled
def test_what_it_leaves_to_torch() -> None:
    x, weight = torch.randn(3, 64), torch.randn(64)
    assert cpu_norm.normed(x.half(), None, weight.half(), 1e-6) is None
    assert cpu_norm.normed(x, None, weight.bfloat16(), 1e-6) is None
    assert cpu_norm.normed(x.t(), None, torch.randn(3), 1e-6) is None  # not contiguous
    assert cpu_norm.normed(x, None, weight[:32], 1e-6) is None
    assert cpu_norm.normed(x.requires_grad_(), None, weight, 1e-6) is None
    wide = torch.randn(1, cpu_norm.GRAIN)
    assert cpu_norm.normed(wide, None, torch.randn(cpu_norm.GRAIN), 1e-6) is None


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
def test_add_rms_norm_is_torchs_add_then_norm(dtype: torch.dtype, rows: int) -> None:
    """post_attention's residual add and norm in one call: the sum written over the block's output."""
    generator = torch.Generator().manual_seed(rows)
    out, residual = ((torch.randn(rows, 1024, generator=generator) * 4).to(dtype) for _ in range(2))
    weight = torch.randn(1024, generator=generator).to(dtype)
    total = residual + out
    other = residual.float() if dtype == torch.bfloat16 else residual.bfloat16()
    assert cpu_norm.normed(out, other, weight, 1e-6) is None  # dtypes differ: out left as it was
    assert cpu_norm.normed(out, residual.repeat(1, 2)[:, ::2], weight, 1e-6) is None  # not contiguous
    normed = cpu_norm.normed(out, residual, weight, 1e-6)
    assert normed is not None
    assert torch.equal(out, total) and torch.equal(normed, _reference(total, weight, 1e-6))


@compiled
def test_few_rows_run_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below torch's grain (a decode step's rows) the kernel runs on the calling thread alone, no
    OpenMP team woken; from it on, on torch's threads; the floats the same either way."""
    real, asked = cpu_norm.kernel(), []
    assert real is not None

    def recording(*args: object) -> None:
        asked.append(args[-1])  # the kernel's `threads`
        real(*args)

    monkeypatch.setattr(cpu_norm, "kernel", lambda: recording)
    weight = torch.randn(1024)
    few, many = torch.randn(4, 1024), torch.randn(cpu_norm.GRAIN // 1024, 1024)
    assert torch.equal(_normed(few, weight, 1e-6), _reference(few, weight, 1e-6))
    assert torch.equal(_normed(many, weight, 1e-6), _reference(many, weight, 1e-6))
    assert asked == [1, torch.get_num_threads()]


def test_a_weights_facts_are_worked_out_once_while_it_lives() -> None:
    """native.Facts: one check per tensor while it lives; a tensor made after one died is checked anew
    (whatever id it is given)."""
    checked: list[int] = []

    def width(t: torch.Tensor) -> int:
        checked.append(t.shape[0])
        return t.shape[0]

    facts = native.Facts(width)
    weight = torch.randn(5)
    assert facts(weight) == 5 and facts(weight) == 5 and checked == [5]
    del weight
    for n in range(6, 40):  # new tensors, some of which may take the freed one's id
        assert facts(torch.randn(n)) == n
    assert checked == list(range(5, 40))
