"""Random weights at a spec's real shapes, deterministic per tensor name (a TensorSource)."""

from __future__ import annotations

import zlib

import torch
from attrs import define

from flowmoe.core.spec import ModelSpec
from flowmoe.model.checkpoint import TORCH_DTYPES
from flowmoe.model.tensor_map import Shape


@define
class RandomSource:
    """Answers every name in the per-expert layout; norms are ones, everything else N(0, std)."""

    spec: ModelSpec
    seed: int = 0
    std: float = 0.02

    def has(self, name: str) -> bool:
        return not name.endswith("experts.gate_up_proj")

    def get(self, name: str, shape: Shape) -> torch.Tensor:
        dtype = TORCH_DTYPES[self.spec.dtype]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) ^ self.seed)
        return (torch.randn(shape, generator=generator, dtype=torch.float32) * self.std).to(dtype)
