"""Numerical comparison helpers."""

from __future__ import annotations

import torch

from flowmoe.core.scheduling import BatchShape


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = ours.float(), ref.float()
    return float((ours - ref).abs().max() / ref.abs().max())


def rectangle(sequences: int, capacity: int, micro_batch: int | None = None, gen: int = 4) -> BatchShape:
    """`sequences` prompts of `capacity - gen` tokens in micro-batches of `micro_batch` (default: one
    micro-batch), each getting `gen` new tokens: caches of `capacity` tokens per sequence."""
    return BatchShape.of([capacity - gen] * sequences, micro_batch or sequences, gen)
