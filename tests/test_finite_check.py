"""The engine's per-step NaN / Inf check of the logits."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmoe.model.moe_model import all_finite


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    shape=st.tuples(st.integers(1, 5), st.integers(1, 40)),
    bad=st.sampled_from([None, float("nan"), float("inf"), float("-inf")]),
    where=st.integers(0, 10_000),
)
def test_all_finite_agrees_with_isfinite(dtype: torch.dtype, shape: tuple[int, int], bad, where: int) -> None:
    """The engine's per-step check of the logits (min and max propagate NaN)."""
    t = torch.randn(shape).to(dtype) * 1e3
    if bad is not None:
        t.view(-1)[where % t.numel()] = bad
    assert all_finite(t) == bool(torch.isfinite(t).all())
    assert all_finite(t[:0])
