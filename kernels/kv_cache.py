"""Per-micro-batch KV cache: one [slots, kv_heads, capacity, head_dim] tensor per layer for K and V.

On the host each tensor lies on transparent huge pages (kernels/host_memory.py): a decode attention
streams the whole cache every step, and reads it faster there than on 4 KiB pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from attrs import define

from flowmoe.kernels.host_memory import huge_zeros
from flowmoe.kernels.layout import TokenLayout

Homes = torch.device | str | Sequence[torch.device]  # one device for every layer's cache, or each layer's


@define
class KVCache:
    keys: list[torch.Tensor]  # per layer [slots, kv_heads, capacity, head_dim]
    values: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        layers: int,
        slots: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: Homes = "cpu",
        value_dim: int | None = None,
    ) -> KVCache:
        """`device`: where every layer's cache lives, or each layer's (a cache split by layer between
        the GPU and the host); `value_dim`: the values' last dimension when not head_dim (MLA caches a
        latent and a RoPE key)."""
        shape = (slots, kv_heads, capacity, head_dim)
        value_shape = (slots, kv_heads, capacity, value_dim or head_dim)
        homes = [device] * layers if isinstance(device, torch.device | str) else list(device)  # [layers]
        return cls(
            keys=[_zeros(shape, dtype, home) for home in homes],
            values=[_zeros(value_shape, dtype, home) for home in homes],
        )

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """One cache tensor: on the host on huge pages, elsewhere by torch's allocator."""
    if torch.device(device).type == "cpu":
        return huge_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def write_kv(
    keys: torch.Tensor, values: torch.Tensor, layout: TokenLayout, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k, v: [T, kv_heads, head_dim] written into keys/values [slots, kv_heads, capacity, head_dim]
    at each token's (slot, position)."""
    positions = layout.positions.to(keys.device)
    slots = layout.token_slots.to(keys.device)
    keys[slots, :, positions] = k.to(keys.device)
    values[slots, :, positions] = v.to(values.device)


def read_kv(
    keys: torch.Tensor, values: torch.Tensor, layout: TokenLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's k, v back out of a cache layer: [T, kv_heads, head_dim] each."""
    positions = layout.positions.to(keys.device)
    slots = layout.token_slots.to(keys.device)
    return keys[slots, :, positions], values[slots, :, positions]
