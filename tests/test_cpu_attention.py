"""The attention kernel (grouped heads as query rows, masks only where needed, keys no query sees
not read, sinks through the logsumexp; decode in cpu_attention.c) against a plain per-query,
per-head softmax in float64, for random shapes, slot orders, mixed prefill / decode steps, sliding
windows, chunks and sinks, in fp32 and bf16, with and without the C kernel (the one this CPU's
features choose: cpu_attention.c on AVX-512, cpu_attention_avx2.c on AVX2); each C kernel this
host runs: its split into chunks and its merge, a sequence's decode the same bits in any batch and
with any thread count; and the matmul form other devices run against the CPU flash kernel."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flowmoe.kernels import cpu_attention
from flowmoe.kernels.attention import _flash, _flash_math, attend
from flowmoe.kernels.layout import TokenLayout

needs_kernel = pytest.mark.skipif(cpu_attention.kernel() is None, reason="no C decode attention on this host")


@contextlib.contextmanager
def forced(name: str) -> Iterator[None]:
    """FLOWMOE_CPU_ISA=name for the block (cpu_attention.isa, worked out once, read afresh in it and
    after it)."""
    with mock.patch.dict(os.environ, {"FLOWMOE_CPU_ISA": name}):
        cpu_attention.isa.cache_clear()
        try:
            yield
        finally:
            cpu_attention.isa.cache_clear()


def each_kernel() -> Iterator[str]:
    """Each C kernel this host runs (cpu_attention.kernels), forced by FLOWMOE_CPU_ISA in turn."""
    for name in cpu_attention.kernels():
        with forced(name):
            assert cpu_attention.isa() == name
            yield name


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
    dim = draw(st.sampled_from([4, 8, 16, 32, 48]))  # 16, 32, 48: the C kernel's decode where it is built
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


def torch_path(off: bool) -> contextlib.AbstractContextManager:
    """With `off`, decode takes torch's path (as on a host without the C kernel)."""
    return mock.patch.object(cpu_attention, "fits", return_value=False) if off else contextlib.nullcontext()


@settings(max_examples=60, deadline=None)
@given(steps(), st.booleans(), st.booleans())
def test_attend_is_a_plain_softmax_per_query(step, strided, off) -> None:
    """`strided`: q a transposed view, as the few-row linear returns it (the flash kernel reads its
    last dimension as contiguous). `off`: without the C decode kernel."""
    q, keys, values, layout, window, sinks, chunk = step
    if strided:
        q = q.reshape(q.shape[0], -1).t().contiguous().t().reshape(q.shape)
    with torch_path(off):
        out = attend(q, keys, values, layout, window, sinks, chunk)
    expected = reference(q, keys, values, layout, window, sinks, chunk)
    assert torch.allclose(out.double(), expected, atol=2e-6, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(steps(), st.booleans())
def test_bf16_is_the_float64_result_rounded(step, off) -> None:
    """bf16 caches: the kernels accumulate in fp32, so only bf16's own rounding remains."""
    q, keys, values, layout, window, sinks, chunk = step
    q, keys, values = (t.to(torch.bfloat16) for t in (q, keys, values))
    with torch_path(off):
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


@st.composite
def decodes(draw):
    """One decode step for cpu_attention.decode: sequences (row, slot, lo, hi) over a cache of
    `capacity`, a chunk far smaller than the key ranges (several chunks per sequence, short last ones)."""
    kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 6))  # 1, 2, 4 heads a pass; 3, 5, 6 mixed
    dim = draw(st.sampled_from([16, 32, 48, 64, 80]))
    capacity, batch = draw(st.integers(1, 90)), draw(st.integers(1, 4))
    slots = draw(st.permutations(range(batch + 1)))[:batch]
    sequences = []
    for row, slot in enumerate(slots):
        hi = draw(st.integers(1, capacity))
        sequences.append((row, slot, draw(st.integers(0, hi - 1)), hi))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    keys, values = (torch.randn(batch + 1, kv_heads, capacity, dim, generator=generator) for _ in range(2))
    q = torch.randn(batch, kv_heads * group, dim, generator=generator)
    sinks = torch.randn(kv_heads * group, generator=generator) if draw(st.booleans()) else None
    return q, keys, values, sequences, sinks, draw(st.integers(1, 40))


def expected_decode(q, keys, values, sequences, sinks) -> torch.Tensor:
    """float64: each query head against its KV head's keys [lo, hi) -> [rows, H * D]."""
    heads, dim = q.shape[1:]
    group = heads // keys.shape[1]
    out = torch.zeros(q.shape[0], heads * dim, dtype=torch.float64)
    for row, slot, lo, hi in sequences:
        for h in range(heads):
            k, v = (t[slot, h // group, lo:hi].double() for t in (keys, values))
            scores = k @ q[row, h].double() * dim**-0.5
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double()])
            out[row, h * dim : (h + 1) * dim] = torch.softmax(scores, dim=0)[: hi - lo] @ v
    return out


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(decodes(), st.booleans())
def test_c_decode_chunks_merge_to_the_softmax(step, bf16) -> None:
    """Ranges split into many chunks (and short last ones), 1-6 query heads per KV head, any slot
    order: the merged chunks give the float64 softmax (bf16: to bf16's rounding)."""
    q, keys, values, sequences, sinks, chunk = step
    assume(not bf16 or q.shape[2] % 32 == 0)
    if bf16:
        q, keys, values = (t.to(torch.bfloat16) for t in (q, keys, values))
    assert cpu_attention.fits(q, keys, values)
    expected = expected_decode(q, keys, values, sequences, sinks)
    atol, rtol = (2e-2, 2e-2) if bf16 else (2e-6, 1e-5)
    for _ in each_kernel():
        out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"), dtype=q.dtype)
        cpu_attention.decode(q, keys, values, sequences, out, sinks, q.shape[2] ** -0.5, chunk)
        assert torch.allclose(out.double(), expected, atol=atol, rtol=rtol)


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(decodes(), st.booleans())
def test_c_decode_is_the_same_bits_in_any_batch_and_thread_count(step, bf16) -> None:
    """Schedulers batch sequences differently and run other thread counts: a sequence's output must
    not change by a bit (chunks depend only on its key range and merge in order)."""
    q, keys, values, sequences, sinks, chunk = step
    assume(not bf16 or q.shape[2] % 32 == 0)
    if bf16:
        q, keys, values = (t.to(torch.bfloat16) for t in (q, keys, values))
    width = q.shape[1] * q.shape[2]
    threads = torch.get_num_threads()
    for _ in each_kernel():
        together = torch.empty(q.shape[0], width, dtype=q.dtype)
        cpu_attention.decode(q, keys, values, sequences, together, sinks, 0.3, chunk)
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            for row, slot, lo, hi in sequences:
                alone = torch.empty(1, width, dtype=q.dtype)
                cpu_attention.decode(
                    q[row : row + 1], keys, values, [(0, slot, lo, hi)], alone, sinks, 0.3, chunk
                )
                assert torch.equal(alone[0], together[row])
        finally:
            torch.set_num_threads(threads)


def test_the_default_kernel_is_the_avx512_one_where_the_library_has_it() -> None:
    """cpu_attention.c's where the host built it (an AVX-512 CPU), else the AVX2 one; FLOWMOE_CPU_ISA
    forces each this host runs, =portable the AVX-512 one."""
    here = cpu_attention.kernels()
    with forced(""):
        assert cpu_attention.isa() == next((n for n in ("avx512", "avx2") if n in here), None)
    with forced("portable"):
        assert "avx512" not in here or cpu_attention.isa() == "avx512"
    assert list(each_kernel()) == list(here)


def test_c_decode_declines_what_it_does_not_compute() -> None:
    """Head sizes off the vector width (16 fp32, 32 bf16), half precision, mixed dtypes, autograd:
    torch's path."""
    keys = torch.zeros(1, 2, 8, 16)
    assert not cpu_attention.fits(torch.zeros(1, 4, 8), keys[..., :8], keys[..., :8])
    assert not cpu_attention.fits(
        torch.zeros(1, 4, 16, dtype=torch.bfloat16), keys.bfloat16(), keys.bfloat16()
    )
    assert not cpu_attention.fits(torch.zeros(1, 4, 16, dtype=torch.float16), keys.half(), keys.half())
    assert not cpu_attention.fits(torch.zeros(1, 4, 16), keys.bfloat16(), keys.bfloat16())
    assert not cpu_attention.fits(torch.zeros(1, 4, 16, requires_grad=True), keys, keys)
    assert cpu_attention.fits(torch.zeros(1, 4, 16), keys, keys) == (cpu_attention.kernel() is not None)


@needs_kernel
def test_c_decode_refuses_sequences_outside_its_tensors() -> None:
    """A slot, row or key range the tensors do not hold raises instead of reading out of bounds."""
    q, keys, out = torch.zeros(2, 4, 16), torch.zeros(3, 2, 8, 16), torch.zeros(2, 64)
    for bad in ((2, 0, 0, 1), (0, 3, 0, 1), (0, 0, 0, 9), (0, 0, 4, 4)):
        with pytest.raises(IndexError, match="outside"):
            cpu_attention.decode(q, keys, keys, [(0, 0, 0, 8), bad], out, None, 0.25)
