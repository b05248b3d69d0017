"""kernels/cpu_rows_avx2.c's wide tiles (from 16 rows of x on: 3 rows of x by 4 weight rows against a
chunk of the weight copied or widened into L1) sum each output in the 1-row kernel's order: a row
gets the same bits alone, beside any other rows and at any thread count, up to AVX2_MAX_ROWS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmoe.kernels import cpu_expert, native
from tests.helpers import rel_err
from tests.test_cpu_experts import TOLERANCE, _error, _ffn, _moe, _tensor, _threads

avx2 = pytest.mark.skipif(
    cpu_expert.library() is None or not {"avx2", "fma"} <= native.cpu_flags(),
    reason="the AVX2 block needs a C compiler and a CPU with AVX2 and FMA",
)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
# columns: below one vector, a bf16 step with a tail, one widened chunk (256), chunks with a tail
COLUMNS = st.sampled_from([5, 16, 67, 256, 300, 1100])


@avx2
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, cpu_expert.AVX2_MAX_ROWS),
    n_in=COLUMNS,
    n_out=st.integers(1, 40),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_linear_rows_bits_alone_and_in_tiles(
    rows: int, n_in: int, n_out: int, dtype: torch.dtype, seed: int
) -> None:
    """x [rows, n_in] @ weight.T: within rounding of float64, the same bits at 1 and 2 threads, and
    each of the first, a middle and the last row the bits it gets alone (the 1-row kernel)."""
    generator = torch.Generator().manual_seed(seed)
    weight = _tensor(generator, n_out, n_in, scale=n_in**-0.5).to(dtype)
    x = _tensor(generator, rows, n_in).to(dtype)
    out = _threads(1, lambda: cpu_expert.linear_rows(x, weight, block="avx2"))  # [rows, n_out]
    assert rel_err(out, F.linear(x.double(), weight.double())) <= TOLERANCE[dtype]
    assert torch.equal(out, _threads(2, lambda: cpu_expert.linear_rows(x, weight, block="avx2")))
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(out[i : i + 1], cpu_expert.linear_rows(x[i : i + 1], weight, block="avx2")), i


@avx2
@settings(max_examples=15, deadline=None)
@given(
    counts=st.lists(st.integers(1, cpu_expert.AVX2_MAX_ROWS), min_size=1, max_size=3),
    hidden=COLUMNS,
    inter=st.sampled_from([24, 37, 300]),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_ffn_group_bits_alone_and_in_tiles(
    counts: list[int], hidden: int, inter: int, dtype: torch.dtype, seed: int
) -> None:
    """A group of experts of up to AVX2_MAX_ROWS rows each: within the fp32 rounding bound (fp32), the
    same bits at 1 and 2 threads, and each expert's first and last rows the bits they get alone."""
    generator = torch.Generator().manual_seed(seed)
    moe = _moe("silu")
    ffns = [_ffn(generator, hidden, inter, dtype, bias=i % 2 == 0) for i in range(len(counts))]
    xs = [_tensor(generator, n, hidden).to(dtype) for n in counts]  # each [n_e, hidden]
    grouped = _threads(1, lambda: cpu_expert.swiglu_group(xs, ffns, moe, block="avx2"))
    two = _threads(2, lambda: cpu_expert.swiglu_group(xs, ffns, moe, block="avx2"))
    assert all(torch.equal(a, b) for a, b in zip(grouped, two, strict=True))
    for x, ffn, out in zip(xs, ffns, grouped, strict=True):
        if dtype == torch.float32:
            assert _error(out, x, ffn, moe) <= TOLERANCE[dtype]
        for i in {0, len(x) - 1}:
            alone = cpu_expert.swiglu_group([x[i : i + 1]], [ffn], moe, block="avx2")[0]
            assert torch.equal(out[i : i + 1], alone), i
