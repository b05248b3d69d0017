"""A paged expert copied to the GPU with one copy operation per PAGE_COPY node.

An expert's tensors lie back to back in its layer's host buffer (flowmoe/model/arena.py, page-locked
in place by runtime/pinned.py), so its bytes are one span of that buffer: `HostSpan` views the span
once per runtime and keeps the view of each byte range a node has asked for. On the device the expert
is one flat buffer, allocated at its first page with its tensors as views into it at the host's
offsets (`land`). A node's pages, `part` to `part + pages - 1` of `parts` equal byte ranges of the
span, are then one `copy_` between the two (`copy_run`), and the expert is whole once every page has
arrived, with nothing left to assemble.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from attrs import define, field

from flowmoe.core.errors import FlowmoeError
from flowmoe.model.quantized import QuantizedExpert
from flowmoe.model.weights import FFNWeights

Paged = FFNWeights | QuantizedExpert  # a packed expert's pages carry its packed bytes


@define
class HostSpan:
    """An expert's tensors in the one host buffer they lie in, in `tensors()` order."""

    flat: torch.Tensor  # uint8 [bytes]: the first byte of the first tensor to the last byte of the last
    offsets: tuple[int, ...]  # where each tensor starts in `flat`
    _runs: dict[tuple[int, int], torch.Tensor] = field(factory=dict)  # byte range -> its view of `flat`

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> HostSpan:
        """The span of `tensors`, which must be contiguous views of one buffer, in order, each at an
        offset its dtype can be viewed at (as an arena packs a layer)."""
        storage = tensors[0].untyped_storage()
        starts = [int(t.storage_offset()) * t.element_size() for t in tensors]
        ends = [s + t.numel() * t.element_size() for s, t in zip(starts, tensors, strict=True)]
        packed = all(
            t.untyped_storage().data_ptr() == storage.data_ptr()
            and t.is_contiguous()
            and (s - starts[0]) % t.element_size() == 0
            for s, t in zip(starts, tensors, strict=True)
        )
        if not packed or any(end > start for end, start in zip(ends, starts[1:], strict=False)):
            raise FlowmoeError(
                "a paged expert's tensors must lie in order in one host buffer (flowmoe.model.arena"
                ".layer_arena packs a layer so; the runtime does it when it page-locks the weights)"
            )
        flat = torch.empty(0, dtype=torch.uint8, device=tensors[0].device)
        flat.set_(storage, starts[0], (ends[-1] - starts[0],), (1,))  # [bytes]
        return cls(flat, tuple(s - starts[0] for s in starts))

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def bounds(self, part: int, parts: int, pages: int) -> tuple[int, int]:
        """The byte range of pages `part` .. `part + pages - 1` of `parts` equal ones."""
        return self.nbytes * part // parts, self.nbytes * (part + pages) // parts

    def run(self, start: int, end: int) -> torch.Tensor:
        """Bytes `start` to `end` of the span (uint8 [end - start]), viewed once per range."""
        view = self._runs.get((start, end))
        if view is None:
            whole = (start, end) == (0, self.nbytes)
            view = self._runs[(start, end)] = self.flat if whole else self.flat[start:end]
        return view


def land(
    weights: Paged, span: HostSpan, device: torch.device, flat: torch.Tensor | None = None
) -> tuple[torch.Tensor, Paged]:
    """A flat buffer on `device` for `weights` (whose bytes `span` holds; `flat`: one given, a slot of
    runtime/expert_slots.py), and the weights as views into it at the host's offsets: the copy's
    pages fill them in place."""
    widest = max(t.element_size() for t in weights.tensors())  # flat must view as each dtype
    if flat is None:
        flat = torch.empty(-(-span.nbytes // widest) * widest, dtype=torch.uint8, device=device)  # [bytes]
    typed: dict[torch.dtype, torch.Tensor] = {}  # dtype -> flat as [bytes / its size]
    views = []
    for tensor, offset in zip(weights.tensors(), span.offsets, strict=True):
        whole = typed.get(tensor.dtype)
        if whole is None:
            whole = typed[tensor.dtype] = flat.view(tensor.dtype)
        at = whole.storage_offset() + offset // tensor.element_size()  # as_strided's offset is the storage's
        views.append(whole.as_strided(tensor.shape, tensor.stride(), at))
    return flat, _rebuilt(weights, views)


def _rebuilt(weights: Paged, tensors: list[torch.Tensor]) -> Paged:
    """`weights` with `tensors` in place of its own (`tensors()` order)."""
    given = iter(tensors)
    if isinstance(weights, FFNWeights):
        return weights.mapped(lambda _: next(given))
    return weights.rebuilt(given)


def copy_run(span: HostSpan, flat: torch.Tensor, part: int, parts: int, pages: int) -> None:
    """Pages `part` .. `part + pages - 1` of `parts` of the span into `flat` (`land`'s buffer): one
    `copy_`, asynchronous from page-locked memory on CUDA."""
    start, end = span.bounds(part, parts, pages)
    target = flat if (start, end) == (0, flat.numel()) else flat[start:end]  # uint8 [end - start]
    target.copy_(span.run(start, end), non_blocking=True)
