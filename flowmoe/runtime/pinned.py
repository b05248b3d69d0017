"""Page-locked host copies of the weights, one arena per layer.

H2D copies run asynchronously and at full link speed only from page-locked
memory. `pin_memory()` per tensor goes through torch's caching host allocator,
which rounds every block up to a power of two (+14% for Mixtral-8x7B's experts,
~96 GiB pinned for the full model). Instead each layer's weights are packed
into one plain host buffer of exactly their size, which is then page-locked in
place (cudaHostRegister), and the layer's tensors become views into it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from attrs import fields

from flowmoe.core.errors import FlowmoeError
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.weights import AttentionWeights, FFNWeights, LayerWeights

ALIGN = 256  # bytes: each tensor starts on a boundary any dtype's view and any DMA engine accepts
PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context (as torch registers)
Register = Callable[[torch.Tensor], None]


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _ffns(lw: LayerWeights) -> list[FFNWeights]:
    return [*lw.experts, *(f for f in (lw.shared, lw.dense) if f is not None)]


def layer_arena(lw: LayerWeights) -> torch.Tensor:
    """Move every tensor of one layer into one host buffer (uint8 [bytes]); returns the buffer.
    The layer's weights are views into it afterwards, with the same values, shapes and dtypes."""
    slots: list[tuple[object, str, torch.Tensor]] = []
    for ffn in _ffns(lw):
        slots += [(ffn, f.name, getattr(ffn, f.name)) for f in fields(FFNWeights)]
    slots += [(lw.attn, f.name, getattr(lw.attn, f.name)) for f in fields(AttentionWeights)]
    fp8 = [w for x in lw.fp8_experts for w in x.weights()]  # expert format fp8: the copies that cross
    slots += [(w, name, getattr(w, name)) for w in fp8 for name in ("values", "scale_inv")]
    slots += [
        (lw, name, getattr(lw, name)) for name in ("router", "router_bias", "shared_gate", "selection_bias")
    ]
    slots = [(owner, name, t) for owner, name, t in slots if t is not None]
    total = sum(_aligned(t.numel() * t.element_size()) for _, _, t in slots)
    arena = torch.empty(total, dtype=torch.uint8)  # [bytes]
    offset = 0
    for owner, name, tensor in slots:
        size = tensor.numel() * tensor.element_size()
        view = arena[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        view.arena = arena  # the buffer lives (and stays page-locked) while any of its views does
        setattr(owner, name, view)
        offset += _aligned(size)
    return arena


def cuda_register(arena: torch.Tensor) -> None:
    """Page-lock `arena` where it lies (no copy, no rounding) until it is freed."""
    size, pointer = arena.numel() * arena.element_size(), arena.data_ptr()
    code = int(torch.cuda.cudart().cudaHostRegister(pointer, size, PORTABLE))
    if code != 0:
        raise FlowmoeError(
            f"could not page-lock {size / 2**30:.2f} GiB of host memory for the weights (CUDA error {code}); "
            "lower the memlock limit's use (ulimit -l) or the model's size"
        )
    weakref.finalize(arena, torch.cuda.cudart().cudaHostUnregister, pointer)


def pin_layers(model: MoEModel, register: Register = cuda_register) -> list[torch.Tensor]:
    """One page-locked arena per layer (the papers' pinned staging area is the weights themselves);
    returns the arenas made, which the layers' tensors keep alive as views. Layers already in an
    arena (a second runtime on the same model) are left as they are."""
    arenas = []
    for lw in model.weights.layers:
        if hasattr(lw.attn.qkv, "arena"):
            continue
        arena = layer_arena(lw)
        register(arena)
        arenas.append(arena)
    return arenas
