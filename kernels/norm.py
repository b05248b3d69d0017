"""RMSNorm as the Hugging Face MoE families compute it: in float32, cast back, then scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowmoe.kernels import cpu_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., dim], weight: [dim] -> [..., dim] in x's dtype: one C call on the CPU where
    the kernel takes them (the same floats), else torch's."""
    out = cpu_norm.normed(x, None, weight, eps)
    return weight * _normed(x, eps) if out is None else out


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim computed in float32, cast back to x's dtype:
    F.rms_norm without a weight is that (its composite upcasts half precision and casts back: the
    same floats, tests/test_step_ops.py), dispatched as one operation instead of seven."""
    return F.rms_norm(x, x.shape[-1:], None, eps)


def norm_of_kind(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: str = "rms") -> torch.Tensor:
    """RMSNorm (weight [dim]) or LayerNorm (kind "layer": weight and bias stacked as [2, dim])."""
    if kind == "layer":
        return F.layer_norm(x, x.shape[-1:], weight[0], weight[1], eps)
    return rms_norm(x, weight, eps)


def add_then_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, kind: str = "rms"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x, its `norm_of_kind`) [..., dim] each. x must be a tensor of the caller's own (a
    block's fresh output): where the kernel takes them, the sum is written over it and both come from
    one C call (the same floats), else from torch's add and norm."""
    if kind == "rms":
        normed = cpu_norm.normed(x, residual, weight, eps)
        if normed is not None:
            return x, normed
    total = residual + x
    return total, norm_of_kind(total, weight, eps, kind)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation over the last dim (Llama 4's QK-norm): [..., dim] -> same."""
    return _normed(x, eps)
