"""Expert feed-forward networks: SwiGLU (SiLU) and GPT-OSS's clamped SwiGLU, with optional biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowmoe.core.spec import MoESpec
from flowmoe.kernels.linear import linear


def swiglu_ffn(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    moe: MoESpec,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [n, hidden], gate_up: [2I, hidden] (gate rows, then up rows), down: [hidden, I] -> [n, hidden]."""
    h = linear(x, gate_up, gate_up_bias)  # [n, 2I]
    gate, up = h.chunk(2, dim=-1)  # [n, I] each
    if moe.activation == "clamped_swiglu":
        gate = gate.clamp(max=moe.swiglu_limit)
        up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))
    else:
        act = F.silu(gate) * up
    return linear(act, down, down_bias)  # [n, hidden]
