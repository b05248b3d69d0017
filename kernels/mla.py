"""Multi-head latent attention (DeepSeek-V2/V3) over a cache of latents.

One down-projection of the normed hidden state gives the query (or its LoRA latent) and, per token,
a compressed KV latent c [r] and one RoPE key k_pe [R] shared by every head. The cache holds c (after
its RMSNorm) as "keys" [slots, 1, C, r] and k_pe as "values" [slots, 1, C, R]: r + R elements per token
and layer instead of 2 · heads · head_dim. Attention never expands c into per-head keys and values: the
up-projection kv_b = [W_uk; W_uv] is absorbed into the query (q_nope · W_uk) and the output (· W_uv),
so every head attends over the latents themselves, which is what a CPU attention reads and what KV
offload moves.
"""

from __future__ import annotations

import torch

from flowmoe.core.spec import MLASpec
from flowmoe.kernels.kv_cache import write_kv
from flowmoe.kernels.layout import TokenLayout
from flowmoe.kernels.linear import linear
from flowmoe.kernels.norm import rms_norm
from flowmoe.kernels.rope import Rotary


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """x: [..., R] stored as (x0, x1), (x2, x3), ... pairs -> [..., R] as x0 x2 ... x1 x3 ..., the
    rotate-half layout (q and k reordered alike: q·k unchanged)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def mla_project(
    x: torch.Tensor,
    down: torch.Tensor,
    q_norm: torch.Tensor | None,
    q_up: torch.Tensor | None,
    kv_norm: torch.Tensor,
    mla: MLASpec,
    heads: int,
    rotary: Rotary,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, hidden] (normed), down: [(q LoRA rank or H * qk_head_dim) + r + R, hidden], rotary of R dims
    -> q [T, H, qk_head_dim] (RoPE part rotated), latent [T, 1, r] (normed), k_pe [T, 1, R] (rotated)."""
    tokens = x.shape[0]
    q_width = mla.q_lora_rank or heads * mla.qk_head_dim
    q, latent, k_pe = linear(x, down).split([q_width, mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    if mla.q_lora_rank:
        assert q_norm is not None and q_up is not None, "a q LoRA rank needs q_norm and q_up"
        q = linear(rms_norm(q, q_norm, eps), q_up)  # [T, H * qk_head_dim]
    q = q.reshape(tokens, heads, mla.qk_head_dim)
    q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
    k_pe = k_pe.reshape(tokens, 1, mla.qk_rope_head_dim)
    if mla.rope_interleave:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q = torch.cat((q_nope, rotary(q_pe)), dim=-1)
    latent = rms_norm(latent, kv_norm, eps).reshape(tokens, 1, mla.kv_lora_rank)
    return q, latent, rotary(k_pe)


def mla_attend(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    layout: TokenLayout,
    kv_up: torch.Tensor,
    mla: MLASpec,
) -> torch.Tensor:
    """Append latent [T, 1, r] and k_pe [T, 1, R] to the cache (latents [S, 1, C, r], RoPE keys
    [S, 1, C, R]) and attend causally: q [T, H, qk_head_dim], kv_up [H * (nope + v), r] -> [T, H * v]."""
    latents, pe_keys = cache
    write_kv(latents, pe_keys, layout, latent, k_pe)
    device = latents.device
    q, kv_up = q.to(device), kv_up.to(device)
    heads = q.shape[1]
    up = kv_up.reshape(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    w_uk, w_uv = up.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)  # [H, nope, r], [H, v, r]
    q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, r]
    scale = mla.softmax_scale or mla.qk_head_dim**-0.5
    positions = layout.positions.to(device)
    if layout.is_decode:  # one query per sequence: every sequence in one batched product
        length = max(layout.advanced())
        slots = layout.slot_index.to(device)
        c = latents[:, 0, :length].index_select(0, slots)  # [B, L, r]
        pe = pe_keys[:, 0, :length].index_select(0, slots)  # [B, L, R]
        allowed = torch.arange(length, device=device) <= positions[:, None]  # [B, L]
        out_lat = _attend_latents(q_lat[:, None], q_pe[:, None], c, pe, allowed[:, None], scale)[:, 0]
    else:
        out_lat = q_lat.new_empty(q_lat.shape)  # [T, H, r]
        for i, slot in enumerate(layout.slots):
            start, count = layout.starts[i], layout.counts[i]
            length = layout.past[i] + count
            rows = slice(start, start + count)
            c, pe = latents[slot, :, :length], pe_keys[slot, :, :length]  # [1, L, r], [1, L, R]
            allowed = torch.arange(length, device=device) <= positions[rows, None]  # [n, L]
            seq = _attend_latents(q_lat[None, rows], q_pe[None, rows], c, pe, allowed[None], scale)
            out_lat[rows] = seq[0]
    return torch.einsum("thr,hvr->thv", out_lat, w_uv).reshape(q.shape[0], heads * mla.v_head_dim)


def _attend_latents(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    c: torch.Tensor,
    pe: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_lat [B, n, H, r], q_pe [B, n, H, R] over the latents c [B, L, r] and RoPE keys pe [B, L, R];
    allowed [B, n, L] -> the attention-weighted latents [B, n, H, r]."""
    scores = torch.einsum("bnhr,blr->bhnl", q_lat, c) + torch.einsum("bnhd,bld->bhnl", q_pe, pe)
    scores = (scores.float() * scale).masked_fill(~allowed[:, None], float("-inf"))  # [B, H, n, L]
    return torch.einsum("bhnl,blr->bnhr", torch.softmax(scores, dim=-1).to(c.dtype), c)
