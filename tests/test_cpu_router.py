"""cpu_router.c's host half of a softmax_topk router against router.py's torch operations: the same
weights (renormalised or not, cast or fp32), rows, scales, experts and counts, bit for bit, for top-k
sums on torch's scalar and vector paths, one token and many."""

from __future__ import annotations

import pytest
import torch

from flowmoe.core.spec import MoESpec
from flowmoe.kernels import cpu_router, router

compiled = pytest.mark.skipif(cpu_router.kernel() is None, reason="no C kernels on this host")


@compiled
@pytest.mark.parametrize(("experts", "k"), [(8, 1), (8, 2), (16, 3), (64, 6), (256, 12)])
@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("norm", "fp32"), [(True, False), (False, False), (True, True)])
def test_route_is_the_torch_routing(
    experts: int, k: int, tokens: int, dtype: torch.dtype, norm: bool, fp32: bool
) -> None:
    moe = MoESpec(experts=experts, top_k=k, intermediate=16, norm_topk=norm, combine_fp32=fp32)
    generator = torch.Generator().manual_seed(experts * 100 + tokens)
    x = torch.randn(tokens, 64, generator=generator).to(dtype)
    weight = torch.randn(experts, 64, generator=generator).to(dtype)
    assert cpu_router.fits(x, moe)
    got = router.route(x, weight, None, moe)
    want = router.group_by_expert(*router.choose(x, weight, None, moe), experts)
    assert got.weights.dtype == want.weights.dtype
    assert torch.equal(got.indices, want.indices) and torch.equal(got.weights, want.weights)
    assert torch.equal(got.rows, want.rows) and torch.equal(got.sorted_scales, want.sorted_scales)
    assert got.experts == want.experts and got.starts == want.starts and got.counts() == want.counts()
    for e in want.experts:
        assert torch.equal(got.tokens[e], want.tokens[e]) and torch.equal(got.scales[e], want.scales[e])


def test_other_routers_and_dtypes_stay_with_torch() -> None:
    x = torch.randn(2, 8)
    assert not cpu_router.fits(x, MoESpec(experts=8, top_k=2, intermediate=16, router="topk_softmax"))
    assert not cpu_router.fits(x.half(), MoESpec(experts=8, top_k=2, intermediate=16))


def test_the_device_half_counts_without_reading_its_input() -> None:
    """sort_by_expert's counts are bincount's, computed by a kernel that does not read its input back
    to size its output (CUDA's bincount does: a stream synchronize on the gate's lane thread): it runs
    on meta tensors, where no data exists to read."""
    indices = torch.tensor([[3, 1], [1, 0], [7, 3], [3, 1]])  # [T, k]
    weights = torch.rand(4, 2)
    rows, scales, counts = router.sort_by_expert(indices, weights, 8)
    assert counts.tolist() == torch.bincount(indices.reshape(-1), minlength=8).tolist()
    assert rows.tolist() == [1, 0, 1, 3, 0, 2, 3, 2]
    assert scales.tolist() == weights.reshape(-1)[[3, 1, 2, 7, 0, 5, 6, 4]].tolist()
    meta = router.sort_by_expert(indices.to("meta"), weights.to("meta"), 8)
    assert [t.shape for t in meta] == [(8,), (8,), (8,)]
