"""Per-micro-batch KV cache: one [slots, kv_heads, capacity, head_dim] tensor per layer for K and V.

On the host each tensor lies on transparent huge pages (kernels/host_memory.py): a decode attention
streams the whole cache every step, and reads it faster there than on 4 KiB pages.

A cache may be split by layer (each layer's tensors on its own device) or by slot (`SlotSplit`:
every layer's first slots on the GPU, the rest on the host, as FlexGen's mixed-device cache is
split along its batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from attrs import define, field, frozen

from flowmoe.kernels import cpu_kv
from flowmoe.kernels.host_memory import huge_zeros
from flowmoe.kernels.layout import TokenLayout
from flowmoe.kernels.no_copy import on


@frozen
class SlotSplit:
    """Every layer's cache split along its slots: the first `kept(slots)` slots (whole sequences) on
    `gpu`, the rest on `cpu` (FlexGen's TorchMixedDevice, whose segments split a cache along its
    batch × heads dimension, rounded to whole sequences)."""

    gpu: torch.device
    kept: Callable[[int], int]  # a micro-batch's cache slots -> how many of them the GPU keeps
    cpu: torch.device = field(factory=lambda: torch.device("cpu"))


# one device for every layer's cache, each layer's, or every layer's split by slot
Homes = torch.device | str | Sequence[torch.device] | SlotSplit


@define
class KVCache:
    keys: list[torch.Tensor]  # per layer [slots, kv_heads, capacity, head_dim] (split by slot: the rest)
    values: list[torch.Tensor]
    kept_keys: list[torch.Tensor] = field(factory=list)  # split by slot: per layer its first `kept` slots
    kept_values: list[torch.Tensor] = field(factory=list)

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
        the GPU and the host), or a `SlotSplit` (every layer's first slots on the GPU, the rest on the
        host); `value_dim`: the values' last dimension when not head_dim (MLA caches a latent and a
        RoPE key)."""
        dims = ((kv_heads, capacity, head_dim), (kv_heads, capacity, value_dim or head_dim))  # keys, values
        split = device if isinstance(device, SlotSplit) else None
        homes: list[torch.device | str]
        if isinstance(device, SlotSplit):
            kept, homes = device.kept(slots), [device.cpu] * layers
        else:
            kept, homes = 0, [device] * layers if isinstance(device, torch.device | str) else list(device)
        cache = cls(  # [layers] of each, the rest's slots where split
            keys=[_zeros((slots - kept, *dims[0]), dtype, home) for home in homes],
            values=[_zeros((slots - kept, *dims[1]), dtype, home) for home in homes],
        )
        if split is not None and kept:  # the GPU's slots of every layer
            cache.kept_keys = [_zeros((kept, *dims[0]), dtype, split.gpu) for _ in range(layers)]
            cache.kept_values = [_zeros((kept, *dims[1]), dtype, split.gpu) for _ in range(layers)]
        return cache

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def kept(self) -> int:
        """The slots of every layer the GPU keeps where the cache is split by slot (else 0)."""
        return self.kept_keys[0].shape[0] if self.kept_keys else 0

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, *self.kept_keys, *self.kept_values)
        return sum(t.numel() * t.element_size() for t in tensors)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values, all its slots (a cache split by slot has no such tensors: `parts`)."""
        if self.kept:
            raise ValueError("a cache split by slot keeps each layer in two parts: read it with parts()")
        return self.keys[layer], self.values[layer]

    def parts(
        self, layer: int
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor]]:
        """A layer's (keys, values) of its first `kept` slots (None where the cache is not split by
        slot), and of the rest: slot i of the rest is the layer's slot `kept` + i."""
        kept = (self.kept_keys[layer], self.kept_values[layer]) if self.kept else None
        return kept, (self.keys[layer], self.values[layer])


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """One cache tensor: on the host on huge pages, elsewhere by torch's allocator."""
    if torch.device(device).type == "cpu":
        return huge_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def write_kv(
    keys: torch.Tensor, values: torch.Tensor, layout: TokenLayout, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k, v: [T, kv_heads, head_dim] written into keys/values [slots, kv_heads, capacity, head_dim]
    at each token's (slot, position): on the host in one C call where `cpu_kv.write` takes them (the
    same bytes)."""
    if not cpu_kv.write(keys, values, layout, k, v):
        write_rows(keys, values, layout.token_slots, layout.positions, k, v)


def write_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k, v: [N, kv_heads, head_dim] written into keys/values at (slots[i], positions[i]) ([N] each),
    moved to the cache's device first."""
    positions, slots = on(positions, keys.device), on(slots, keys.device)
    keys[slots, :, positions] = on(k, keys.device)
    values[slots, :, positions] = on(v, values.device)


def store_kv(cache: KVCache, layer: int, layout: TokenLayout, k: torch.Tensor, v: torch.Tensor) -> None:
    """This step's k, v [T, kv_heads, head_dim] into a layer of `cache` at each token's (slot,
    position): where the cache is split by slot, each token into the part that holds its slot, so only
    the tokens of the rest's slots move to the rest's device."""
    kept, rest = cache.parts(layer)
    if kept is None:
        write_kv(*rest, layout, k, v)
        return
    slots, positions = layout.token_slots, layout.positions  # [T] each
    ours = slots < cache.kept  # [T]: tokens of the kept slots
    for (keys, values), rows, first in ((kept, ours, 0), (rest, ~ours, cache.kept)):
        if rows.any():
            picked = rows.to(k.device)
            write_rows(keys, values, slots[rows] - first, positions[rows], k[picked], v[picked])


def read_kv(
    keys: torch.Tensor, values: torch.Tensor, layout: TokenLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's k, v back out of a cache layer: [T, kv_heads, head_dim] each."""
    positions = on(layout.positions, keys.device)
    slots = on(layout.token_slots, keys.device)
    return keys[slots, :, positions], values[slots, :, positions]
