"""The attention kernel (grouped heads as query rows, masks only where needed, keys no query sees
not read, sinks through the logsumexp) against a plain per-query, per-head softmax in float64, for
random shapes, slot orders, mixed prefill / decode steps, sliding windows, chunks and sinks, in
fp32 and bf16; and the matmul form other devices run against the CPU flash kernel."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowmoe.kernels.attention import _flash, _flash_math, attend
from flowmoe.kernels.layout import TokenLayout


def reference(q, keys, values, layout, window, sinks, chunk) -> torch.Tensor:
    """q: [T, H, D], keys/values: [S, kvh, C, D] -> [T, H * D] float64, one query and head at a time."""
    tokens, heads, dim = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(tokens, heads * dim, dtype=torch.float64)
    for slot, start, count, past in zip(layout.slots, layout.starts, layout.counts, layout.past, strict=True):
        for t in range(count):
            pos = past + t
            j = torch.arange(pos + 1)
            visible = torch.ones(pos + 1, dtype=torch.bool)
            if window is not None:
                visible &= j > pos - window
            if chunk is not None:
                visible &= j // chunk == pos // chunk
            for h in range(heads):
                k = keys[slot, h // group, : pos + 1].double()  # [pos + 1, D]
                v = values[slot, h // group, : pos + 1].double()
                scores = (k @ q[start + t, h].double() * dim**-0.5).masked_fill(~visible, float("-inf"))
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h : h + 1].double()])
                probs = torch.softmax(scores, dim=0)[: pos + 1]
                out[start + t, h * dim : (h + 1) * dim] = probs @ v
    return out


@st.composite
def steps(draw):
    kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dim = draw(st.sampled_from([4, 8, 16]))
    capacity = draw(st.integers(1, 40))
    sequences = draw(st.integers(1, 5))
    slots = draw(st.permutations(range(sequences + draw(st.integers(0, 2)))))[:sequences]
    if draw(st.booleans()):
        slots = sorted(slots)  # consecutive runs are the common case
    counts, past = [], []
    for _ in slots:
        count = draw(st.integers(1, capacity)) if draw(st.booleans()) else 1
        counts.append(count)
        past.append(draw(st.integers(0, capacity - count)))
    layout = TokenLayout(tuple(slots), tuple(counts), tuple(past))
    window = draw(st.none() | st.integers(1, capacity + 2))
    chunk = draw(st.none() | st.integers(1, capacity + 2))
    seed = draw(st.integers(0, 2**31 - 1))
    with_sinks = draw(st.booleans())
    generator = torch.Generator().manual_seed(seed)
    n_slots = max(slots) + 1
    keys, values = (torch.randn(n_slots, kv_heads, capacity, dim, generator=generator) for _ in range(2))
    q = torch.randn(layout.tokens, kv_heads * group, dim, generator=generator)
    sinks = torch.randn(kv_heads * group, generator=generator) if with_sinks else None
    return q, keys, values, layout, window, sinks, chunk


@settings(max_examples=60, deadline=None)
@given(steps(), st.booleans())
def test_attend_is_a_plain_softmax_per_query(step, strided) -> None:
    """`strided`: q a transposed view, as the few-row linear returns it (the flash kernel reads its
    last dimension as contiguous)."""
    q, keys, values, layout, window, sinks, chunk = step
    if strided:
        q = q.reshape(q.shape[0], -1).t().contiguous().t().reshape(q.shape)
    out = attend(q, keys, values, layout, window, sinks, chunk)
    expected = reference(q, keys, values, layout, window, sinks, chunk)
    assert torch.allclose(out.double(), expected, atol=2e-6, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(steps())
def test_bf16_is_the_float64_result_rounded(step) -> None:
    """bf16 caches: the kernel accumulates in fp32, so only bf16's own rounding remains."""
    q, keys, values, layout, window, sinks, chunk = step
    q, keys, values = (t.to(torch.bfloat16) for t in (q, keys, values))
    out = attend(q, keys, values, layout, window, sinks, chunk)
    assert out.dtype == torch.bfloat16
    expected = reference(q, keys, values, layout, window, sinks, chunk)
    assert torch.allclose(out.double(), expected, atol=2e-2, rtol=2e-2)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(1, 30),
    st.sampled_from([4, 8]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_matmul_form_equals_the_cpu_kernel(batch, rows, length, dim, masked, seed) -> None:
    """What CUDA runs (_flash_math) gives the CPU kernel's output and logsumexp."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, 2, n, dim, generator=generator) for n in (rows, length, length))
    mask = None
    if masked:
        hidden = torch.rand(batch, 1, rows, length, generator=generator) < 0.4
        hidden[..., 0] = False  # every row sees a key
        mask = torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
    out, lse = _flash(q, k, v, mask, dim**-0.5, lse=True)
    math_out, math_lse = _flash_math(q, k, v, mask, dim**-0.5, lse=True)
    assert torch.allclose(math_out, _flash_math(q, k, v, mask, dim**-0.5, lse=False)[0], atol=1e-6)
    assert torch.allclose(out, math_out, atol=1e-6) and torch.allclose(lse, math_lse, atol=1e-6)
