"""Host weights packed into one buffer per layer (and one for the embedding, final norm and LM head).

Each buffer is on transparent huge pages where the OS grants them (kernels/host_memory.py): the CPU
reads an expert or a projection at up to a third more bandwidth than on 4 KiB pages. With CUDA the
same buffer is page-locked in place (flowmoe/runtime/pinned.py), so the copies to the GPU run
asynchronously from it without a second host copy or the caching host allocator's power-of-two
rounding (+14% for Mixtral-8x7B's experts). The layer's tensors become aligned views of the buffer,
with the same values, shapes and dtypes; a view's `arena` attribute is the buffer it lives in.
"""

from __future__ import annotations

import torch
from attrs import fields

from flowmoe.kernels.host_memory import huge_empty
from flowmoe.model.weights import AttentionWeights, FFNWeights, LayerWeights, ModelWeights

ALIGN = 256  # bytes: each tensor starts on a boundary any dtype's view and any DMA engine accepts

Slot = tuple[object, str, torch.Tensor]  # (owner, attribute, tensor)


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _pack(slots: list[Slot]) -> torch.Tensor:
    """Copy every slot's tensor into one new buffer (uint8 [bytes]) and point its owner at the view."""
    slots = [(owner, name, t) for owner, name, t in slots if t is not None]
    total = sum(_aligned(t.numel() * t.element_size()) for _, _, t in slots)
    arena = huge_empty(total)  # [bytes]
    offset = 0
    for owner, name, tensor in slots:
        size = tensor.numel() * tensor.element_size()
        view = arena[offset : offset + size].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        # the buffer lives (and stays page-locked) while any of its views does
        view.arena = arena  # type: ignore[attr-defined]  # a Python attribute on a tensor, not a torch field
        setattr(owner, name, view)
        offset += _aligned(size)
    return arena


def _ffns(lw: LayerWeights) -> list[FFNWeights]:
    return [*lw.experts, *(f for f in (lw.shared, lw.dense) if f is not None)]


def layer_arena(lw: LayerWeights) -> torch.Tensor:
    """Move every tensor of one layer into one host buffer (uint8 [bytes]); returns the buffer."""
    slots: list[Slot] = []
    for ffn in _ffns(lw):
        slots += [(ffn, f.name, getattr(ffn, f.name)) for f in fields(FFNWeights)]
    slots += [(lw.attn, f.name, getattr(lw.attn, f.name)) for f in fields(AttentionWeights)]
    slots += [(owner, name, getattr(owner, name)) for x in lw.packed for owner, name in x.slots()]
    slots += [
        (lw, name, getattr(lw, name)) for name in ("router", "router_bias", "shared_gate", "selection_bias")
    ]
    return _pack(slots)


def top_arena(weights: ModelWeights) -> torch.Tensor:
    """The embedding, final norm and LM head in one host buffer (a tied LM head stays the embedding)."""
    tied = weights.lm_head is weights.embed
    slots: list[Slot] = [(weights, "embed", weights.embed), (weights, "final_norm", weights.final_norm)]
    arena = _pack(slots if tied else [*slots, (weights, "lm_head", weights.lm_head)])
    if tied:
        weights.lm_head = weights.embed
    return arena


def arena_of(lw: LayerWeights) -> torch.Tensor | None:
    """The buffer layer `lw` is packed in, if it is."""
    return getattr(lw.attn.qkv, "arena", None)
