"""Numerical comparison helpers."""

from __future__ import annotations

import torch


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = ours.float(), ref.float()
    return float((ours - ref).abs().max() / ref.abs().max())
