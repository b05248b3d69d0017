"""Numerical comparison helpers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from flowmoe.core.scheduling import BatchShape

if TYPE_CHECKING:
    from flowmoe.jobs.engine import StepInput
    from flowmoe.model.moe_model import MoEModel


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = ours.float(), ref.float()
    return float((ours - ref).abs().max() / ref.abs().max())


def rectangle(sequences: int, capacity: int, micro_batch: int | None = None, gen: int = 4) -> BatchShape:
    """`sequences` prompts of `capacity - gen` tokens in micro-batches of `micro_batch` (default: one
    micro-batch), each getting `gen` new tokens: caches of `capacity` tokens per sequence."""
    return BatchShape.of([capacity - gen] * sequences, micro_batch or sequences, gen)


class Successor:
    """A stand-in JobRunner whose next token is always the last one + 1 (with the byte tokenizer:
    "a" -> "bcd..."), the cache on the CPU and no GPU budget to check; `caches` holds each step's
    KV cache size (slots x capacity tokens)."""

    cache_device = torch.device("cpu")

    def __init__(self) -> None:
        self.caches: list[int] = []

    def check_memory(self, batch: BatchShape) -> None:
        return None

    async def __call__(self, model: MoEModel, inputs: Sequence[StepInput]) -> list[torch.Tensor]:
        out = []
        for step in inputs:
            self.caches.append(step.cache.keys[0].shape[0] * step.cache.capacity)
            last = step.ids[step.layout.last_rows]  # [B]
            logits = torch.zeros(len(last), model.spec.vocab)  # [B, vocab]
            logits[torch.arange(len(last)), last + 1] = 1.0
            out.append(logits)
        return out
