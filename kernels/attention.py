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
12-18% faster than the flash kernel's bf16 path at one query per sequence (bench/RESULTS.md),
as does every call on other devices (CUDA). Attention sinks add exp(sink) to a row's softmax
denominator, so the output is scaled by sigmoid(logsumexp - sink).
"""

from __future__ import annotations

import torch

from flowmoe.kernels import cpu_attention
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
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, H * D]
    decoding = [i for i, count in enumerate(layout.counts) if count == 1]
    if decoding and cpu_attention.fits(q, keys, values):  # each query sees one range of keys: no mask
        sequences = []  # (q / out row, cache slot, first and past-the-last key)
        for i in decoding:
            past = layout.past[i]
            lowest = _first_visible(past, window, chunk)
            sequences.append((layout.starts[i], layout.slots[i], lowest, past + 1))
        cpu_attention.decode(q, keys, values, sequences, out, sinks, q.shape[2] ** -0.5)
        decoding = []
    for run in _slot_runs([layout.slots[i] for i in decoding]):
        members = [decoding[j] for j in run]
        rows = [layout.starts[i] for i in members]
        pasts = [layout.past[i] for i in members]
        first = layout.slots[members[0]]
        together = q[rows[0] : rows[-1] + 1] if rows == list(range(rows[0], rows[-1] + 1)) else q[rows]
        out_rows = _attend_group(
            together[:, None],  # [b, 1, H, D]
            keys[first : first + len(members)],
            values[first : first + len(members)],
            pasts,
            window,
            sinks,
            chunk,
        )  # [b, 1, H * D]
        out[rows] = out_rows[:, 0]
    for i in range(len(layout.counts)):
        if layout.counts[i] == 1:
            continue
        slot, start, count, past = layout.slots[i], layout.starts[i], layout.counts[i], layout.past[i]
        out[start : start + count] = _attend_group(
            q[start : start + count][None],  # [1, n, H, D]
            keys[slot : slot + 1],
            values[slot : slot + 1],
            [past],
            window,
            sinks,
            chunk,
        )[0]
    return out


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


def _attend_group(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: list[int],
    window: int | None,
    sinks: torch.Tensor | None,
    chunk: int | None,
) -> torch.Tensor:
    """q: [b, n, H, D] (b sequences of n new tokens each, after past[i] cached ones), keys/values:
    [b, kvh, C, D] their cache slots -> [b, n, H * D]."""
    batch, n, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    length = max(past) + n
    lowest = _first_visible(min(past), window, chunk)
    k, v = keys[:, :, lowest:length], values[:, :, lowest:length]  # [b, kvh, L', D] views
    qg = q.permute(0, 2, 1, 3).reshape(batch, kv_heads, group * n, dim)  # [b, kvh, g * n, D]: head-major rows
    mask = None
    if n > 1 or min(past) != max(past):  # else every query sees keys lowest..length-1, all of them
        q_pos = torch.tensor(past, device=q.device)[:, None] + torch.arange(n, device=q.device)  # [b, n]
        allowed = _mask(q_pos, length, window, chunk)[..., lowest:]  # [b, n, L']
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~allowed, float("-inf")
        )
        mask = mask[:, None, None].expand(batch, 1, group, n, mask.shape[-1])  # [b, 1, g, n, L']
        mask = mask.reshape(batch, 1, group * n, mask.shape[-1])
    fused = q.device.type == "cpu" and (q.dtype == torch.float32 or n > 1)
    products = _flash if fused else _flash_math
    out, lse = products(qg, k, v, mask, dim**-0.5, sinks is not None)  # [b, kvh, g * n, D], [b, kvh, g * n]
    if lse is not None and sinks is not None:  # lse comes back only when there are sinks
        sink = sinks.reshape(kv_heads, group, 1).expand(kv_heads, group, n).reshape(kv_heads, group * n)
        out = (out.float() * torch.sigmoid(lse - sink.float())[..., None]).to(q.dtype)
    return out.reshape(batch, heads, n, dim).transpose(1, 2).reshape(batch, n, heads * dim)


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
