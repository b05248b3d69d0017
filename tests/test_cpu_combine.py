"""kernels.cpu_combine: a layer's combine in one C call gives the floats of torch's path bit for bit."""

from __future__ import annotations

import pytest
import torch

from flowmoe.kernels import cpu_combine

compiled = pytest.mark.skipif(cpu_combine.kernel() is None, reason="no C compiler for the CPU kernels here")


def _torch_combine(hidden: torch.Tensor, rows: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor:
    """MoEModel.routed_sum's operations, then the residual add."""
    moe = torch.zeros_like(hidden)
    values = torch.cat(outputs)
    return hidden + moe.index_add_(0, rows, values.to(moe.dtype))


@compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "width"), [(1, 1024), (5, 300), (40, 37), (1024, 1024)])
def test_combine_is_torchs_floats(
    dtype: torch.dtype, values_dtype: torch.dtype, tokens: int, width: int
) -> None:
    """Experts whose tokens overlap, added in the order given: the same bits as index_add_ and the
    add, at 1 and 2 threads (each element's sums in one order whatever the threads)."""
    generator = torch.Generator().manual_seed(tokens * width)
    counts = [min(tokens, n) for n in (1, 3, tokens, 2, tokens, tokens)]  # up to 6 adds per row
    rows = torch.cat([torch.randperm(tokens, generator=generator)[:n] for n in counts])  # [sum n_e]
    outputs = [torch.randn(n, width, generator=generator).to(values_dtype) for n in counts]  # [n_e, H] each
    wide = torch.randn(tokens, width + 3, generator=generator).to(dtype)
    hidden = wide[:, 1 : 1 + width]  # rows with a stride of their own
    expected = _torch_combine(hidden, rows, outputs)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = cpu_combine.combine(hidden, rows, outputs)
            assert out is not None and out.dtype == dtype and torch.equal(out, expected), threads
    finally:
        torch.set_num_threads(before)


@compiled
def test_what_it_does_not_take() -> None:
    hidden, rows = torch.zeros(2, 8), torch.zeros(1, dtype=torch.int64)
    assert cpu_combine.combine(hidden, rows[:0], []) is None
    assert cpu_combine.combine(hidden, rows, [torch.zeros(1, 8, dtype=torch.float16)]) is None
    assert cpu_combine.combine(hidden, rows.repeat(2), [torch.zeros(8, 2).t()]) is None  # not contiguous
    assert cpu_combine.combine(hidden.half(), rows, [torch.zeros(1, 8)]) is None
    mixed = [torch.zeros(1, 8), torch.zeros(1, 8).bfloat16()]
    assert cpu_combine.combine(hidden, rows.repeat(2), mixed) is None  # mixed dtypes
    assert cpu_combine.combine(hidden.t(), rows, [torch.zeros(1, 2)]) is None  # strided columns


@compiled
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 1024), (2, 1024), (7, 37)])
def test_scale_rows_is_torchs_product(
    values_dtype: torch.dtype, scales_dtype: torch.dtype, rows: int, width: int
) -> None:
    """Expert outputs times their rows' combine weights: torch's values * scales[:, None] bit for bit,
    scales as [n] or [n, 1]; non-contiguous scales go to torch."""
    generator = torch.Generator().manual_seed(rows * width)
    values = (torch.randn(rows, width, generator=generator) * 100).to(values_dtype)  # [n, H]
    scales = torch.rand(rows, 1, generator=generator).to(scales_dtype)  # [n, 1]
    expected = values * scales
    for given in (scales, scales.view(-1), torch.cat([scales, scales], dim=1)[:, 0]):
        out = torch.full_like(expected, float("nan"))
        cpu_combine.scale_rows(values, given, out)
        assert torch.equal(out, expected)
