"""What a family multiplies into attention scores beyond head_dim ** -0.5, applied to the queries:
Llama 4's temperature on NoPE layers (growing with the position) and Granite's attention_multiplier."""

from __future__ import annotations

import torch

from flowmoe.core.spec import AttentionSpec


def scale_queries(q: torch.Tensor, a: AttentionSpec, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """q: [T, H, D], positions: [T] int64 -> q scaled so that q·k * head_dim ** -0.5 is the family's score."""
    if a.temperature is not None and not a.uses_rope(layer):
        attn_scale, floor_scale = a.temperature
        pos = positions.to(q.device, torch.float32)
        temp = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0  # [T]
        q = (q * temp[:, None, None]).to(q.dtype)
    if a.scale is not None:
        q = q * (a.scale * a.head_dim**0.5)
    return q
