"""RMSNorm as the Hugging Face MoE families compute it: in float32, cast back, then scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], weight: [dim] -> [..., dim] in x's dtype."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def norm_of_kind(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: str = "rms") -> torch.Tensor:
    """RMSNorm (weight [dim]) or LayerNorm (kind "layer": weight and bias stacked as [2, dim])."""
    if kind == "layer":
        return F.layer_norm(x, x.shape[-1:], weight[0], weight[1], eps)
    return rms_norm(x, weight, eps)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation over the last dim (Llama 4's QK-norm): [..., dim] -> same."""
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
