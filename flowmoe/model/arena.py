"""Host weights packed into one buffer per layer (and one for the embedding, final norm and LM head).

Each buffer is on transparent huge pages where the OS grants them (kernels/host_memory.py): the CPU
reads an expert or a projection at up to a third more bandwidth than on 4 KiB pages. With CUDA the
same buffer is page-locked in place (flowmoe/runtime/pinned.py), so the copies to the GPU run
asynchronously from it without a second host copy or the caching host allocator's power-of-two
rounding (+14% for Mixtral-8x7B's experts). The layer's tensors become aligned views of the buffer,
with the same values, shapes and dtypes; a view's `arena` attribute is the buffer it lives in.

A checkpoint's layer is laid out before it is read (`plan_layer`, from its tensors' shapes), so its
stacked tensors (q k v, gate up) are written straight into their places and every other tensor is
copied in from its view of the file, let go as soon as it is: loading holds each weight once, plus
at most a few tensors in flight (issue 25: peak RSS within 1.15x the weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from attrs import define, fields

from flowmoe.kernels.host_memory import huge_empty
from flowmoe.model.tensor_map import Stack
from flowmoe.model.weights import AttentionWeights, FFNWeights, LayerWeights, ModelWeights

ALIGN = 256  # bytes: each tensor starts on a boundary any dtype's view and any DMA engine accepts
CHUNK = 16 << 20  # bytes: a tensor read from a mapped file is copied in chunks of this, each let go

Slot = tuple[object, str, torch.Tensor]  # (owner, attribute, tensor)


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _layout(slots: list[Slot], dtype: torch.dtype | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One new buffer (uint8 [bytes]) for the slots' tensors and, in order, the view each will be
    (same shape; same dtype, or `dtype`)."""
    dtypes = [dtype or t.dtype for _, _, t in slots]
    total = sum(_aligned(t.numel() * d.itemsize) for (_, _, t), d in zip(slots, dtypes, strict=True))
    arena = huge_empty(total)  # [bytes]
    views, offset = [], 0
    for (_, _, tensor), dt in zip(slots, dtypes, strict=True):
        size = tensor.numel() * dt.itemsize
        view = arena[offset : offset + size].view(dt).view(tensor.shape)
        # the buffer lives (and stays page-locked) while any of its views does
        view.arena = arena  # type: ignore[attr-defined]  # a Python attribute on a tensor, not a torch field
        views.append(view)
        offset += _aligned(size)
    return arena, views


def _fill(slots: list[Slot], views: list[torch.Tensor]) -> None:
    """Point each slot's owner at its view, copying the tensor in unless it was written there
    already; each tensor is let go as soon as it is in (the list is emptied), so a view of a mapped
    file unmaps then."""
    slots.reverse()
    for view in views:
        owner, name, tensor = slots.pop()
        if tensor.data_ptr() != view.data_ptr():
            copy_in(view, tensor)
        setattr(owner, name, view)


def copy_in(view: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """view.copy_(tensor) (converting its dtype); a tensor viewing a mapped file (model/checkpoint.py:
    it has `release`) a chunk at a time, each chunk's pages let go once copied (and converted), so
    the file is never resident whole, nor a tensor's pages beside the next one's. Returns `view`."""
    release = getattr(tensor, "release", None)
    size = tensor.element_size()
    if release is None or not tensor.is_contiguous() or not view.is_contiguous():
        return view.copy_(tensor)
    source, target, step = tensor.reshape(-1), view.reshape(-1), CHUNK // size
    for start in range(0, source.numel(), step):
        target[start : start + step].copy_(source[start : start + step])
        release(start * size, min(start + step, source.numel()) * size)
    return view


def _pack(slots: list[Slot], plan: ArenaPlan | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Move every slot's tensor into one buffer (uint8 [bytes]): the planned one where the slots
    match its layout's shapes (each converted to its view's dtype as it is copied in), else a new
    one, of the tensors' dtypes or `dtype`."""
    slots = [(owner, name, t) for owner, name, t in slots if t is not None]
    if plan is None or [v.shape for v in plan.views] != [t.shape for _, _, t in slots]:
        plan = ArenaPlan(*_layout(slots, dtype), [])
    _fill(slots, plan.views)
    return plan.arena


@define
class ArenaPlan:
    """A layer's buffer laid out from its shapes before its weights are read: the view each slot
    will be, and for each call of the layer's `stack` the view its result is written into (None: a
    result that is not a slot as it is)."""

    arena: torch.Tensor  # uint8 [bytes]
    views: list[torch.Tensor]
    stacked: list[torch.Tensor | None]
    _calls: int = 0

    def stack(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """torch.cat(parts) into the place planned for this call's result, each part copied into its
        rows by `copy_in` (converted to the plan's dtype, a mapped part's pages let go as copied)."""
        view = self.stacked[self._calls] if self._calls < len(self.stacked) else None
        self._calls += 1
        if view is None:
            return torch.cat(parts)
        row = 0
        for part in parts:
            copy_in(view[row : row + part.shape[0]], part)
            row += part.shape[0]
        return view


def plan_layer(build: Callable[[Stack], LayerWeights]) -> ArenaPlan:
    """The plan of the layer `build(stack)` makes, from a build of it on meta tensors (shapes and
    dtypes, no data): `build` must make the same layer, with the same calls of `stack`, again.
    Each stacked result is made by `new_empty`, not torch.cat: concatenating meta tensors imports
    sympy for torch's symbolic shapes (~800 modules, 69 MiB resident for the rest of the run), so
    `build` must not concatenate its tensors but through `stack`."""
    results: list[torch.Tensor] = []

    def record(parts: list[torch.Tensor]) -> torch.Tensor:
        rows = sum(p.shape[0] for p in parts)
        results.append(parts[0].new_empty((rows, *parts[0].shape[1:])))  # torch.cat(parts)'s shape
        return results[-1]

    slots = [slot for slot in layer_slots(build(record)) if slot[2] is not None]
    arena, views = _layout(slots)
    where = {id(t): view for (_, _, t), view in zip(slots, views, strict=True)}
    return ArenaPlan(arena, views, [where.get(id(r)) for r in results])


def _ffns(lw: LayerWeights) -> list[FFNWeights]:
    return [*lw.experts, *(f for f in (lw.shared, lw.dense) if f is not None)]


def layer_slots(lw: LayerWeights) -> list[Slot]:
    """Every tensor slot of one layer, in the order its arena holds them."""
    slots: list[Slot] = []
    for ffn in _ffns(lw):
        slots += [(ffn, f.name, getattr(ffn, f.name)) for f in fields(FFNWeights)]
    slots += [(lw.attn, f.name, getattr(lw.attn, f.name)) for f in fields(AttentionWeights)]
    slots += [(owner, name, getattr(owner, name)) for x in lw.packed for owner, name in x.slots()]
    slots += [
        (lw, name, getattr(lw, name)) for name in ("router", "router_bias", "shared_gate", "selection_bias")
    ]
    return slots


def layer_arena(lw: LayerWeights, plan: ArenaPlan | None = None) -> torch.Tensor:
    """Move every tensor of one layer into one host buffer (uint8 [bytes]), the one `plan` laid out
    where it was planned for this layer; returns the buffer."""
    return _pack(layer_slots(lw), plan)


def top_arena(weights: ModelWeights, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The embedding, final norm and LM head in one host buffer, converted to `dtype` if given (a
    tied LM head stays the embedding). An untied embedding that views a mapped file (it has
    `release`, model/checkpoint.py) stays there, as stored: a step reads only its tokens' rows, from
    the file (model/file_rows.py), and MoEModel.embed converts those, so the table is never resident
    (the issue's 32000 x 1024: 62.5 MiB in bf16, 125 MiB in fp32)."""
    tied = weights.lm_head is weights.embed
    mapped = not tied and hasattr(weights.embed, "release")
    packed = (("embed", not mapped), ("final_norm", True), ("lm_head", not tied))
    names = [name for name, kept in packed if kept]
    arena = _pack(
        [(weights, name, getattr(weights, name)) for name in names], dtype=dtype
    )  # only _pack holds them
    if tied:
        weights.lm_head = weights.embed
    return arena


def arena_of(lw: LayerWeights) -> torch.Tensor | None:
    """The buffer layer `lw` is packed in, if it is."""
    return getattr(lw.attn.qkv, "arena", None)
