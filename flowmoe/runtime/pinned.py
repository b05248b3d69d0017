"""Page-locked host weights: each layer's arena (flowmoe/model/arena.py) registered with CUDA in place.

H2D copies run asynchronously and at full link speed only from page-locked memory. `pin_memory()`
per tensor goes through torch's caching host allocator, which rounds every block up to a power of
two (+14% for Mixtral-8x7B's experts, ~96 GiB pinned for the full model) and keeps a second copy.
Instead the one buffer a layer's weights already live in is page-locked where it lies
(cudaHostRegister).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from flowmoe.core.errors import FlowmoeError
from flowmoe.model.arena import arena_of, layer_arena
from flowmoe.model.moe_model import MoEModel

PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context (as torch registers)
Register = Callable[[torch.Tensor], Callable[[], object] | None]  # -> its release (None: nothing to undo)


def cuda_register(arena: torch.Tensor) -> Callable[[], object]:
    """Page-lock `arena` where it lies (no copy, no rounding) until it is freed or the returned
    release is called (once, whichever comes first)."""
    size, pointer = arena.numel() * arena.element_size(), arena.data_ptr()
    code = int(torch.cuda.cudart().cudaHostRegister(pointer, size, PORTABLE))
    if code != 0:
        raise FlowmoeError(
            f"could not page-lock {size / 2**30:.2f} GiB of host memory for the weights (CUDA error {code}); "
            "lower the memlock limit's use (ulimit -l) or the model's size"
        )
    return weakref.finalize(arena, torch.cuda.cudart().cudaHostUnregister, pointer)


def pin_layers(model: MoEModel, register: Register = cuda_register) -> list[torch.Tensor]:
    """Page-lock every layer's arena (packing a layer that is not in one yet: a model built by hand);
    returns the arenas registered now, each with its release as `page_locked` (`unpin`). An arena
    already page-locked (a second runtime open on the same model) is left as it is."""
    arenas = []
    for lw in model.weights.layers:
        arena = arena_of(lw)
        if arena is None:
            arena = layer_arena(lw)
        elif getattr(arena, "page_locked", None) is not None:
            continue
        arena.page_locked = register(arena) or (lambda: None)  # type: ignore[attr-defined]  # see arena.py
        arenas.append(arena)
    return arenas


def unpin(arenas: list[torch.Tensor]) -> None:
    """Undo `pin_layers`' registration of `arenas` (the runtime that pinned them is closing)."""
    for arena in arenas:
        release = arena.page_locked  # type: ignore[attr-defined]  # a Python attribute on a tensor
        arena.page_locked = None  # type: ignore[attr-defined]  # a Python attribute on a tensor
        release()
