"""Causal grouped-query attention over a KV cache, with sliding windows, attention sinks and chunks.

Decode on the CPU (every sequence of the step with one new token, fp32 or bf16, head dim a
multiple of 16 or 32) runs in one call of kernels/cpu_attention.c: each query sees one contiguous range
of keys (no mask), read once per KV head for its g query heads, long caches split across the
threads. The rest (prefills, other dtypes and devices, hosts without the C kernel) as follows.
A KV group's g query heads are stacked as g query rows against their KV head, so K and V are
read once, in place in the cache (a run of consecutive cache slots is one call; no gathered
K/V). A mask is built only where some key must be hidden (shorter sequences of a batch,
windows, chunks, causality within a prefill), and keys no query of the call can see (before
every window or chunk) are not read at all. fp32 on the CPU, and every CPU prefill, run in
torch's flash-attention kernel (the one F.scaled_dot_product_attention dispatches to there,
called directly because it also returns each row's logsumexp): no scores tensor, no float
copy. Half-precision decode runs as two (oneDNN) matmuls around a float32 softmax, measured
12-18% faster than the flash kernel's bf16 path at one query per sequence (bench/RESULTS.md)
where torch has native bf16 matmuls (on AVX2 it emulates them: the flash kernel, 5x faster there),
as does every call on other devices (CUDA). Attention sinks add exp(sink) to a row's softmax
denominator, so the output is scaled by sigmoid(logsumexp - sink).
"""

from __future__ import annotations

import torch
from attrs import frozen

from flowmoe.kernels import cpu_attention
from flowmoe.kernels.cpu_expert import emulated
from flowmoe.kernels.layout import TokenLayout


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: TokenLayout,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """q: [T, heads, D]; keys/values: [slots, kv_heads, capacity, D] already holding this step's
    tokens -> [T, heads * D]. `chunk`: a query sees only keys of its own chunk of positions.
    Sequences with one new token (decode) are attended together, one call per run of
    consecutive cache slots; the others (a prefill, alone or sharing the step with decodes) one by one."""
    tokens, heads, dim = q.shape
    kv_heads = keys.shape[1]
    decoding = [i for i, count in enumerate(layout.counts) if count == 1]
    out = None
    if decoding and cpu_attention.fits(q, keys, values):  # each query sees one range of keys: no mask
        out = q.new_empty(tokens, heads * dim)  # [T, H * D]
        sequences = layout.derived(
            ("decode ranges", window, chunk), lambda: _decode_ranges(layout, window, chunk)
        )
        cpu_attention.decode(q, keys, values, sequences, out, sinks, dim**-0.5)
        if len(decoding) == len(layout.counts):  # a decode step: no prefill left
            return out
        decoding = []
    group = heads // kv_heads
    key = ("decode runs", tuple(decoding), window, chunk, group, q.dtype, q.device)
    runs: list[_Run] = layout.derived(key, lambda: _decode_runs(layout, decoding, group, window, chunk, q))
    for run in runs:
        whole = isinstance(run.rows, slice) and run.rows == slice(0, tokens)  # the step's every row, in order
        qg = (q if whole else q[run.rows]).reshape(run.count, kv_heads, group, dim)  # [b, kvh, g, D]
        k, v = (_reach(t, run.first, run.count, run.lowest, run.length) for t in (keys, values))
        out_rows = _attend_group(qg, k, v, run.mask, 1, sinks).reshape(run.count, heads * dim)  # [b, H * D]
        if whole:  # no copy into `out`
            return out_rows
        if out is None:
            out = q.new_empty(tokens, heads * dim)  # [T, H * D]
        out[run.rows] = out_rows
    if out is None:
        out = q.new_empty(tokens, heads * dim)  # [T, H * D]
    for i in range(len(layout.counts)):
        if layout.counts[i] == 1:
            continue
        slot, start, count, past = layout.slots[i], layout.starts[i], layout.counts[i], layout.past[i]
        qg = q[start : start + count][None].permute(0, 2, 1, 3).reshape(1, kv_heads, group * count, dim)
        lowest = _first_visible(past, window, chunk)
        mask = _additive_mask([past], count, group, lowest, window, chunk, q)  # [1, 1, g * n, L'] or None
        k, v = (_reach(t, slot, 1, lowest, past + count) for t in (keys, values))
        out_group = _attend_group(qg, k, v, mask, count, sinks)  # [1, kvh, g * n, D]
        out[start : start + count] = (
            out_group.reshape(heads, count, dim).transpose(0, 1).reshape(count, heads * dim)
        )
    return out


def _decode_ranges(
    layout: TokenLayout, window: int | None, chunk: int | None
) -> list[tuple[int, int, int, int]]:
    """The step's decoding sequences as `cpu_attention.decode` takes them: (q / out row, cache slot,
    first and past-the-last key), the same for every layer of the step with this window and chunk."""
    sequences = []
    for i, count in enumerate(layout.counts):
        if count == 1:
            past = layout.past[i]
            sequences.append(
                (layout.starts[i], layout.slots[i], _first_visible(past, window, chunk), past + 1)
            )
    return sequences


@frozen
class _Run:
    """Decoding sequences in consecutive cache slots, attended in one call."""

    rows: slice | torch.Tensor  # their query rows in q
    first: int  # the first one's cache slot
    count: int  # b
    lowest: int  # the first key position any of them sees
    length: int  # past the last key position any of them sees
    mask: torch.Tensor | None  # [b, 1, g, L'] additive, or None where each sees every key lowest..length-1


def _decode_runs(
    layout: TokenLayout,
    decoding: list[int],
    group: int,
    window: int | None,
    chunk: int | None,
    like: torch.Tensor,
) -> list[_Run]:
    """The step's decoding sequences (indices into the layout) as runs of consecutive cache slots, each
    with its mask (the same for every layer of the step with this window and chunk)."""
    runs = []
    for run in _slot_runs([layout.slots[i] for i in decoding]):
        members = [decoding[j] for j in run]
        starts = [layout.starts[i] for i in members]
        pasts = [layout.past[i] for i in members]
        contiguous = starts == list(range(starts[0], starts[-1] + 1))
        rows = slice(starts[0], starts[-1] + 1) if contiguous else torch.tensor(starts, device=like.device)
        lowest = _first_visible(min(pasts), window, chunk)
        mask = _additive_mask(pasts, 1, group, lowest, window, chunk, like)
        runs.append(_Run(rows, layout.slots[members[0]], len(members), lowest, max(pasts) + 1, mask))
    return runs


def _reach(cache: torch.Tensor, first: int, count: int, lowest: int, length: int) -> torch.Tensor:
    """cache [slots, kvh, C, D] -> the view [count, kvh, length - lowest, D]: slots first.., keys lowest.."""
    if first or count != cache.shape[0]:
        cache = cache.narrow(0, first, count)
    return cache.narrow(2, lowest, length - lowest)


def _slot_runs(slots: list[int]) -> list[list[int]]:
    """Indices into `slots` split where the next slot is not the previous one plus one."""
    runs: list[list[int]] = []
    for j, slot in enumerate(slots):
        if runs and slots[runs[-1][-1]] + 1 == slot:
            runs[-1].append(j)
        else:
            runs.append([j])
    return runs


def _mask(q_pos: torch.Tensor, length: int, window: int | None, chunk: int | None = None) -> torch.Tensor:
    """q_pos: [..., n] -> allowed: [..., n, L] (key j visible to a query at p if j <= p, p - j < window,
    j // chunk == p // chunk)."""
    k_pos = torch.arange(length, device=q_pos.device)
    allowed = k_pos <= q_pos[..., None]
    if window is not None:
        allowed &= k_pos > q_pos[..., None] - window
    if chunk is not None:
        allowed &= k_pos // chunk == q_pos[..., None] // chunk
    return allowed


def _first_visible(first: int, window: int | None, chunk: int | None) -> int:
    """The first key position a query at `first` or later can see."""
    lowest = 0
    if window is not None:
        lowest = max(lowest, first - window + 1)
    if chunk is not None:
        lowest = max(lowest, first // chunk * chunk)
    return lowest


def _additive_mask(
    past: list[int],
    n: int,
    group: int,
    lowest: int,
    window: int | None,
    chunk: int | None,
    like: torch.Tensor,
) -> torch.Tensor | None:
    """Of b sequences of n new tokens each after past[i] cached ones, keys from `lowest` on: the mask
    [b, 1, g * n, L'] (0 visible, -inf hidden; head-major rows, `like`'s dtype and device) added to the
    scores of their g query heads per KV head, or None where every query sees every key."""
    if n == 1 and min(past) == max(past):  # every query sees keys lowest..length-1, all of them
        return None
    batch, length = len(past), max(past) + n
    q_pos = torch.tensor(past, device=like.device)[:, None] + torch.arange(n, device=like.device)  # [b, n]
    allowed = _mask(q_pos, length, window, chunk)[..., lowest:]  # [b, n, L']
    mask = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(
        ~allowed, float("-inf")
    )
    mask = mask[:, None, None].expand(batch, 1, group, n, mask.shape[-1])  # [b, 1, g, n, L']
    return mask.reshape(batch, 1, group * n, mask.shape[-1])


def _attend_group(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    n: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """qg: [b, kvh, g * n, D] (b sequences of n new tokens each, a KV group's g query heads stacked
    head-major against their KV head), k/v: [b, kvh, L', D] the keys they may see, mask: additive
    [b, 1, g * n, L'] or None -> [b, kvh, g * n, D]."""
    kv_heads, rows, dim = qg.shape[1], qg.shape[2], qg.shape[3]
    fused = qg.is_cpu and (qg.dtype == torch.float32 or n > 1 or emulated(qg.dtype))
    products = _flash if fused else _flash_math
    out, lse = products(qg, k, v, mask, dim**-0.5, sinks is not None)  # [b, kvh, g * n, D], [b, kvh, g * n]
    if lse is not None and sinks is not None:  # lse comes back only when there are sinks
        group = rows // n
        sink = sinks.reshape(kv_heads, group, 1).expand(kv_heads, group, n).reshape(kv_heads, rows)
        out = (out.float() * torch.sigmoid(lse - sink.float())[..., None]).to(qg.dtype)
    return out


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [b, h, m, D], k/v: [b, h, L, D], mask: additive, broadcast to [b, h, m, L] or None
    -> out [b, h, m, D] in q's dtype, and (if `lse`) the rows' logsumexp [b, h, m] float32."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernel assumes it
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=mask, scale=scale
    )
    return out, logsumexp if lse else None


def _flash_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_flash` as two matmuls around a float32 softmax (scores rounded to q's dtype first, as a
    half-precision matmul gives them)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [b, h, m, L]
    if mask is not None:
        scores = scores + mask
    if not lse:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v), None
    logsumexp = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - logsumexp[..., None]).to(v.dtype), v), logsumexp
