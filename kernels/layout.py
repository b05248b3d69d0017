"""TokenLayout: where the packed tokens of one step of a micro-batch come from.

A step packs the new tokens of every sequence of a micro-batch into one
[T, hidden] tensor with no padding: sequence i owns rows
starts[i] : starts[i] + counts[i], lives in KV-cache slot slots[i] and has
past[i] tokens cached before this step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from typing import Any

import torch
from attrs import field, frozen


@frozen
class TokenLayout:
    slots: tuple[int, ...]
    counts: tuple[int, ...]
    past: tuple[int, ...]
    starts: tuple[int, ...] = field(init=False)
    positions: torch.Tensor = field(init=False)  # [T] int64, position of each token in its sequence
    token_slots: torch.Tensor = field(init=False)  # [T] int64, cache slot of each token
    slot_index: torch.Tensor = field(init=False)  # [B] int64, cache slot of each sequence
    last_rows: torch.Tensor = field(init=False)  # [B] int64, the row of each sequence's last token
    # what the layers of a step derive from the layout alike (attention masks), built once per step
    _derived: dict[Hashable, Any] = field(init=False, factory=dict, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        starts, total = [], 0
        for count in self.counts:
            starts.append(total)
            total += count
        object.__setattr__(self, "starts", tuple(starts))
        positions = [p + j for p, c in zip(self.past, self.counts, strict=True) for j in range(c)]
        token_slots = [s for s, c in zip(self.slots, self.counts, strict=True) for _ in range(c)]
        object.__setattr__(self, "positions", torch.tensor(positions, dtype=torch.int64))
        object.__setattr__(self, "token_slots", torch.tensor(token_slots, dtype=torch.int64))
        object.__setattr__(self, "slot_index", torch.tensor(self.slots, dtype=torch.int64))
        last = [
            s + c - 1 for s, c in zip(starts, self.counts, strict=True)
        ]  # the tokens that predict the next
        object.__setattr__(self, "last_rows", torch.tensor(last, dtype=torch.int64))

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """What `build` derives from this layout (tensors on this layout's device), built by the first
        layer that asks for `key` and shared by the step's others; a racing second build is harmless."""
        if key not in self._derived:
            self._derived.setdefault(key, build())
        return self._derived[key]

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    @property
    def is_decode(self) -> bool:
        return all(c == 1 for c in self.counts)

    def to(self, device: torch.device) -> TokenLayout:
        """The same layout with its index tensors on `device` (copied without blocking the host
        where the source is page-locked), so kernels on that device upload nothing per layer."""
        moved = copy.copy(self)
        object.__setattr__(moved, "_derived", {})  # derived on the other device anew
        for name in ("positions", "token_slots", "slot_index", "last_rows"):
            tensor = getattr(self, name)
            if device.type == "cuda":
                tensor = tensor.pin_memory()
            object.__setattr__(moved, name, tensor.to(device, non_blocking=True))
        return moved

    def advanced(self) -> tuple[int, ...]:
        """Cached lengths after this step."""
        return tuple(p + c for p, c in zip(self.past, self.counts, strict=True))
