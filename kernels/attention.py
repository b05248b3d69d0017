"""Causal grouped-query attention over a KV cache, with sliding windows and attention sinks."""

from __future__ import annotations

import torch

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
    Sequences with one new token (decode) are attended all at once;
    the others (a prefill, alone or sharing the step with decodes) one by one."""
    if layout.is_decode:
        return _decode(q, keys, values, layout, window, sinks, chunk)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, H * D]
    decoding = [i for i, count in enumerate(layout.counts) if count == 1]
    if len(decoding) > 1:
        rows = torch.tensor([layout.starts[i] for i in decoding], device=q.device)
        single = TokenLayout(tuple(layout.slots[i] for i in decoding), (1,) * len(decoding),
                             tuple(layout.past[i] for i in decoding))  # fmt: skip
        out[rows] = _decode(q[rows], keys, values, single, window, sinks, chunk)
    alone = [i for i in range(len(layout.counts)) if len(decoding) < 2 or i not in decoding]
    for i in alone:
        slot, start, count, past = layout.slots[i], layout.starts[i], layout.counts[i], layout.past[i]
        length = past + count
        out[start : start + count] = _attend_one(
            q[start : start + count],  # [n, H, D]
            keys[slot, :, :length],  # [kvh, L, D]
            values[slot, :, :length],
            torch.arange(past, length, device=q.device),
            window,
            sinks,
            chunk,
        )
    return out


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


def _softmax_values(
    scores: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None
) -> torch.Tensor:
    """scores: [..., kvh, a, b, L] float32 (a × b: the group's query heads × queries, in either
    order), v: [..., kvh, L, D], sink: the heads' sink logits shaped to broadcast as [..., kvh, a, b, 1]
    -> [..., kvh, a, b, D]."""
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sink.to(torch.float32).expand(*scores.shape[:-1], 1)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v.unsqueeze(-3))


def _attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """q: [n, H, D], k/v: [kvh, L, D] -> [n, H * D]."""
    n, heads, dim = q.shape
    kv_heads, length = k.shape[0], k.shape[1]
    qg = q.transpose(0, 1).reshape(kv_heads, heads // kv_heads, n, dim)  # [kvh, g, n, D]
    scores = torch.matmul(qg, k.unsqueeze(1).transpose(-1, -2)).float() * dim**-0.5  # [kvh, g, n, L]
    sink = sinks.reshape(kv_heads, -1, 1, 1) if sinks is not None else None  # [kvh, g, 1, 1]
    out = _softmax_values(scores, _mask(q_pos, length, window, chunk), v, sink)  # [kvh, g, n, D]
    return out.reshape(heads, n, dim).transpose(0, 1).reshape(n, heads * dim)


def _decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layout: TokenLayout,
    window: int | None,
    sinks: torch.Tensor | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """One query per sequence: q [B, H, D] -> [B, H * D], all sequences in one batched matmul.
    A group's g query heads stand in the queries' place, so K and V are read as they lie in the
    cache (one [g, D] @ [D, L] product per sequence and KV head, no copy of K or V per head)."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    length = max(layout.advanced())
    k, v = _gather_slots(keys, layout, length), _gather_slots(values, layout, length)
    qg = q.reshape(batch, kv_heads, 1, heads // kv_heads, dim)  # [B, kvh, 1, g, D]
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).float() * dim**-0.5  # [B, kvh, 1, g, L]
    q_pos = layout.positions.to(q.device).reshape(batch, 1, 1, 1)
    sink = sinks.reshape(kv_heads, 1, -1, 1) if sinks is not None else None  # [kvh, 1, g, 1]
    out = _softmax_values(scores, _mask(q_pos, length, window, chunk), v, sink)  # [B, kvh, 1, g, D]
    return out.reshape(batch, heads * dim)


def _gather_slots(cache: torch.Tensor, layout: TokenLayout, length: int) -> torch.Tensor:
    """cache: [S, kvh, C, D] -> [B, kvh, length, D]; a view when the slots are consecutive."""
    slots, first = layout.slots, layout.slots[0]
    if slots == tuple(range(first, first + len(slots))):
        return cache[first : first + len(slots), :, :length]
    return cache[:, :, :length].index_select(0, layout.slot_index.to(cache.device))
