"""Weights resident on the GPU: each layer's dense part and individual experts, copied in and
evicted by PAGE_COPY and EVICT nodes. Using an expert that is not resident is an error, which is
how a scheduler that forgets a copy (or evicts too early) is caught.

Without CUDA the "GPU" is the CPU and a resident copy is the CPU tensor itself. Where the GPU holds
copies, a native expert lands in a slot of one pool (runtime/expert_slots.py: a group of experts on
the device is then one strided view, the grouped GEMM's operand) where the accounting allows it.

An expert of a packed format (int8, int4, hqq4, fp8) crosses packed and stays packed on the device
until its first use, which dequantizes it into the model's dtype on the using lane's stream (the
compute stream: its node already waits there for the copy's event) and keeps that in its place for
its later uses, once per arrival: the copy lane's stream only copies. At most one expert is held
both packed and dequantized at once (the dequantization's working set: core/memory.py).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import overload

import torch
from attrs import define, field, fields, frozen
from torch import cuda

from flowmoe.core.errors import FlowmoeError, MemoryBudgetError
from flowmoe.core.memory import gib
from flowmoe.core.policy import ExpertFormat
from flowmoe.core.scheduling import Residency
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.quantized import QuantizedExpert
from flowmoe.model.weights import AttentionWeights, FFNWeights, LayerWeights
from flowmoe.runtime.expert_slots import ExpertSlots
from flowmoe.runtime.paged_copy import HostSpan, Paged, copy_run, land


class NotResident(FlowmoeError):
    """A node used weights that are not on the GPU."""


_HELD: dict[int, tuple[str, int]] = {}  # id of an open DeviceWeights -> (device, the most bytes it holds)
_HELD_LOCK = threading.Lock()


def _hold(owner: object, device: torch.device, nbytes: int, budget: int | None) -> Callable[[], None]:
    """Count `nbytes` of `owner`'s weights on `device` in the process's ledger, refused where the
    weights other open runtimes may hold there leave no room under `budget` (a runtime alone is held
    to it by its memory check before the run); returns the release (also run when `owner` is
    collected unclosed)."""
    with _HELD_LOCK:
        others = [n for where, n in _HELD.values() if where == str(device)]
        if budget is not None and others and sum(others) + nbytes > budget:  # alone: the run's own check
            raise MemoryBudgetError(
                f"the weights need {gib(nbytes)} of {device} next to {gib(sum(others))} that {len(others)} "
                f"runtime(s) not closed still hold, over the {gib(budget)} budget: close() a runtime (or "
                "use it in a with block) before creating the next"
            )
        _HELD[id(owner)] = (str(device), nbytes)
    return weakref.finalize(owner, _release, id(owner))


def _release(key: int) -> None:
    with _HELD_LOCK:
        _HELD.pop(key, None)


def held_bytes(device: torch.device) -> int:
    """Bytes of weights the open runtimes of this process may hold on `device` (flowmoe's ledger)."""
    with _HELD_LOCK:
        return sum(n for where, n in _HELD.values() if where == str(device))


@frozen
class Devices:
    gpu: torch.device
    cpu: torch.device = field(factory=lambda: torch.device("cpu"))

    @property
    def cuda(self) -> bool:
        return self.gpu.type == "cuda"

    @property
    def copies(self) -> bool:
        """Whether weights on the GPU are copies on another device (without CUDA the "GPU" is the
        host, and a resident weight is the host tensor itself)."""
        return self.gpu != self.cpu

    @classmethod
    def detect(cls, want: str = "auto") -> Devices:
        if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
            return cls(torch.device("cpu"))
        if not torch.cuda.is_available():
            raise FlowmoeError("--device cuda asked for, but torch sees no CUDA device")
        return cls(torch.device("cuda", torch.cuda.current_device()))

    @overload
    def to_gpu(self, tensor: torch.Tensor) -> torch.Tensor: ...
    @overload
    def to_gpu(self, tensor: None) -> None: ...
    @overload
    def to_gpu(self, tensor: torch.Tensor | None) -> torch.Tensor | None: ...
    def to_gpu(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(self.gpu, non_blocking=True)

    def to_cpu(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.cpu, non_blocking=False)

    def to_cpu_lane(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` on its way to the host for a CPU-lane node, which waits for the copy's node
        (devices/cuda.py, `EventBook.wait_host`): asynchronous on CUDA (torch lands it in
        page-locked memory), so the copy lane's thread neither blocks nor spins on the device. The
        source is the copy stream's until the copy has run (record_stream): its caller may drop it."""
        host = tensor.to(self.cpu, non_blocking=True)
        if tensor.is_cuda:
            tensor.record_stream(cuda.current_stream(tensor.device))
        return host


def _ffn_to(devices: Devices, ffn: FFNWeights) -> FFNWeights:
    return ffn.mapped(devices.to_gpu)


def _dense_to(devices: Devices, lw: LayerWeights) -> LayerWeights:
    attn = AttentionWeights(
        **{f.name: devices.to_gpu(getattr(lw.attn, f.name)) for f in fields(AttentionWeights)}
    )
    return LayerWeights(
        attn=attn,
        router=devices.to_gpu(lw.router),
        router_bias=devices.to_gpu(lw.router_bias),
        experts=[],
        shared=_ffn_to(devices, lw.shared) if lw.shared is not None else None,
        shared_gate=devices.to_gpu(lw.shared_gate),
        dense=_ffn_to(devices, lw.dense) if lw.dense is not None else None,
        selection_bias=devices.to_gpu(lw.selection_bias),
    )


def _layer_tensors(lw: LayerWeights) -> list[torch.Tensor]:
    attn = [getattr(lw.attn, f.name) for f in fields(AttentionWeights)]
    ffns = [t for ffn in (lw.shared, lw.dense) if ffn is not None for t in ffn.tensors()]
    router = (lw.router, lw.router_bias, lw.shared_gate, lw.selection_bias)
    return [t for t in (*attn, *router, *ffns) if t is not None]


def _check_packed(model: MoEModel, expert_format: ExpertFormat) -> None:
    for layer, lw in enumerate(model.weights.layers):
        if lw.router is not None and len(lw.packed) != model.spec.moe.experts:
            raise FlowmoeError(
                f"expert format {expert_format}: the experts of layer {layer} are not packed (load the "
                f"model as `flowmoe run --expert-format {expert_format}` does: flowmoe.model.loading."
                f"load_model(..., packing=Packing('{expert_format}')))"
            )


@define
class _Arriving:
    """A paged expert partly copied: its weights on the GPU (views of `flat`), the pages in so far."""

    weights: FFNWeights | QuantizedExpert
    flat: torch.Tensor | None  # uint8 [bytes] on the GPU (`land`); None: the "GPU" is the host
    pages: set[int] = field(factory=set)


@define
class DeviceWeights:
    """Which weights are on the GPU, and how many bytes they hold.

    PAGE_COPY and EVICT run on different lane threads (gpu.h2d and gpu.compute), so every change
    and every read of the residency goes through one lock, and the byte and expert counters are
    kept as they change: reading them is O(1), never a walk over the resident weights."""

    model: MoEModel
    devices: Devices
    _dense: dict[int, LayerWeights] = field(factory=dict)
    # a packed expert: as it crossed, until its first use dequantizes it (where the "GPU" is the host
    # it stays packed, and `expert` hands it out as a PackedFFN)
    _experts: dict[tuple[int, int], FFNWeights | QuantizedExpert] = field(factory=dict)
    _partial: dict[tuple[int, int], _Arriving] = field(factory=dict)
    _spans: dict[tuple[int, int], HostSpan] = field(factory=dict)  # (layer, expert) -> its host bytes, once
    limit: int | None = None  # bytes of layer weights allowed on the GPU (set by setup)
    embed: torch.Tensor | None = None
    head: tuple[torch.Tensor, torch.Tensor] | None = None  # final norm, lm head
    _bytes: int = 0  # bytes of every dense part, expert and partly copied expert held
    _sizes: dict[tuple[int, int], int] = field(factory=dict)  # (layer, expert or -1) -> bytes
    _lock: threading.Lock = field(factory=threading.Lock)
    # other than "native": an expert crosses packed (LayerWeights.packed), dequantized at its first use
    expert_format: ExpertFormat = "native"
    _release: Callable[[], None] | None = None  # its entry in the process's ledger (set by setup)
    _pool: ExpertSlots | None = None  # the experts' slots (set by setup where `_pooled` takes them)
    _slots: dict[tuple[int, int], int] = field(factory=dict)  # (layer, expert) -> the slot it holds

    def setup(
        self, residency: Residency, buffer_bytes: int, budget: int | None = None, ends: bool = True
    ) -> None:
        """Embedding and head live on the GPU (but where `ends` is False: a CPU-only schedule's run);
        then what the scheduler keeps resident. From then on, weights copied in may exceed the
        resident set by `buffer_bytes` at most. All of it is counted in the process's ledger first,
        refused where the runtimes not closed leave no room for it under `budget`."""
        w = self.model.weights
        if self.expert_format != "native":
            _check_packed(self.model, self.expert_format)
        for layer, lw in enumerate(w.layers):
            self._sizes[(layer, -1)] = lw.dense_nbytes
            self._sizes.update({(layer, e): lw.expert_nbytes(e) for e in range(len(lw.experts or lw.packed))})
        resident = sum(self._size(layer, -1) for layer in residency.dense)
        resident += sum(self._size(layer, expert) for layer, expert in residency.experts)
        end_bytes = w.embed.numel() * self.model.dtype.itemsize + w.final_norm.nbytes + w.lm_head.nbytes
        self._release = _hold(self, self.devices.gpu, end_bytes * ends + resident + buffer_bytes, budget)
        self._pool = self._pooled(residency, buffer_bytes)
        if ends:  # converted on the host where it is copied (it may still be as stored in its checkpoint)
            self.embed = self.devices.to_gpu(w.embed.to(self.model.dtype) if self.devices.copies else w.embed)
            self.head = (self.devices.to_gpu(w.final_norm), self.devices.to_gpu(w.lm_head))
        for layer in sorted(residency.dense):
            self.load(layer, -1)
        for layer, expert in sorted(residency.experts):
            self.load(layer, expert)
        self.limit = self._bytes + buffer_bytes

    def load(self, layer: int, expert: int, part: int = -1, parts: int = 1, pages: int = 1) -> None:
        """PAGE_COPY: expert -1 is the layer's dense part (attention, router, shared/dense MLP).
        With `part` >= 0 an expert arrives in `parts` pages, `pages` of them from `part` on in this
        call (one copy operation: runtime/paged_copy.py; all of them: as a whole expert), and is
        resident after the last one.
        Copies are enqueued (asynchronous on CUDA), so holding the lock over them is short."""
        source = self.model.weights.layers[layer]
        key = (layer, expert)
        with self._lock:
            if key in self._experts or (expert < 0 and layer in self._dense):
                what = f"expert {expert}" if expert >= 0 else "the dense part"
                raise FlowmoeError(
                    f"{what} of layer {layer} is copied to the GPU while already resident there"
                )
            if key not in self._partial:
                self._reserve(layer, expert)
            if expert < 0:
                self._dense[layer] = _dense_to(self.devices, source)
            elif self._pool is not None and (part < 0 or pages == parts):  # whole: one copy into a slot
                self._load_pages(layer, expert, 0, 1, 1)
            elif part < 0 or pages == parts:  # whole: tensor by tensor, one copy each
                self._experts[key] = self._expert_to(source, expert)
            else:
                self._load_pages(layer, expert, part, parts, pages)

    def _expert_to(self, lw: LayerWeights, expert: int) -> FFNWeights | QuantizedExpert:
        """A whole expert onto the GPU: in the model's dtype, or packed (dequantized at its first use:
        `expert`); packed as it is where the "GPU" is the host (the CPU's packed kernels read it so:
        model/packed_experts.py)."""
        if self.expert_format == "native":
            return _ffn_to(self.devices, lw.expert(expert))
        packed = lw.packed[expert]
        return packed.to(self.devices.gpu) if self.devices.copies else packed

    def _load_pages(self, layer: int, expert: int, part: int, parts: int, pages: int) -> None:
        key = (layer, expert)
        lw = self.model.weights.layers[layer]
        ffn = lw.experts[expert] if self.expert_format == "native" else lw.packed[expert]
        arriving = self._partial.get(key)
        if arriving is None:  # its first page: packed pages land in a packed buffer
            if self.devices.copies:
                span = self._spans.get(key)
                if span is None:
                    span = self._spans[key] = HostSpan.of(ffn.tensors())
                flat, landed = self._land(key, ffn, span)
                arriving = _Arriving(landed, flat)
            else:  # the "GPU" is the host: the resident copy is the tensor itself
                arriving = _Arriving(ffn, None)
            self._partial[key] = arriving
        if arriving.flat is not None:
            copy_run(self._spans[key], arriving.flat, part, parts, pages)
        arriving.pages.update(range(part, part + pages))
        if len(arriving.pages) == parts:
            self._experts[key] = arriving.weights
            del self._partial[key]

    def _land(self, key: tuple[int, int], ffn: Paged, span: HostSpan) -> tuple[torch.Tensor, Paged]:
        """Under the lock, an expert's first page: its buffer on the device and its weights as views of
        it; a slot of the pool where there is one (its copy waits for the slot: ExpertSlots.take)."""
        pool = self._pool
        if pool is None:
            return land(ffn, span, self.devices.gpu)
        slot = self._slots[key] = pool.take()
        landed = pool.landed.get(slot)
        if landed is None:
            landed = pool.landed[slot] = land(ffn, span, self.devices.gpu, pool.room(slot))
            for tensor in landed[1].tensors():
                tensor.arena = pool.pool  # type: ignore[attr-defined]  # where the grouped path keeps its views
        return landed

    def _size(self, layer: int, expert: int) -> int:
        size = self._sizes.get((layer, expert))
        if size is None:  # setup not run (a bare DeviceWeights): measure once
            source = self.model.weights.layers[layer]
            size = self._sizes[(layer, expert)] = (
                source.expert_nbytes(expert) if expert >= 0 else source.dense_nbytes
            )
        return size

    def _reserve(self, layer: int, expert: int) -> None:
        """Under the lock: count a new dense part or expert (a paged one from its first page)."""
        size = self._size(layer, expert)
        if self.limit is not None and self._bytes + size > self.limit:
            what = f"expert {expert}" if expert >= 0 else "the dense part"
            raise MemoryBudgetError(
                f"copying {what} of layer {layer} would hold {gib(self._bytes + size)} of weights on the GPU "
                f"(over the scheduler's declared {gib(self.limit)})"
            )
        self._bytes += size

    def evict(self, layer: int, expert: int) -> None:
        """EVICT, launched on the lane that used the weights last: on CUDA their memory is only
        reused once that lane's stream has finished with them (record_stream)."""
        with self._lock:
            if expert < 0:
                dense = self._dense.pop(layer, None)
                tensors = [] if dense is None else _layer_tensors(dense)
                dropped = dense is not None
            else:
                ffn = self._experts.pop((layer, expert), None)
                partial = self._partial.pop((layer, expert), None)
                dropped = ffn is not None or partial is not None
                tensors = [*(ffn.tensors() if ffn else []), *(partial.weights.tensors() if partial else [])]
            if dropped:
                self._bytes -= self._size(layer, expert)
            slot = self._slots.pop((layer, expert), None)
            if slot is not None:  # the pool's own guard: its next copy waits for this stream
                assert self._pool is not None
                self._pool.give(slot)
                tensors = []
        if self.devices.cuda:
            stream = cuda.current_stream(self.devices.gpu)
            for tensor in tensors:
                tensor.record_stream(stream)

    def _pooled(self, residency: Residency, buffer_bytes: int) -> ExpertSlots | None:
        """The experts' slots, as many as the resident experts and `buffer_bytes` of whole experts: where
        the GPU holds copies (on CUDA only with FLOWMOE_EXPERT_SLOTS=1 until a GPU run checks it;
        FLOWMOE_EXPERT_SLOTS=0: nowhere), native experts lie each in one host span of one size and
        layout, that size is what the accounting charges per expert, and every dense part is resident
        (the buffer then holds experts alone: the pool is no more than the ledger holds)."""
        want = os.environ.get("FLOWMOE_EXPERT_SLOTS", "")
        layers = self.model.weights.layers
        if (
            self.expert_format != "native"
            or not self.devices.copies
            or not (want == "1" or (want == "" and not self.devices.cuda))
            or set(range(len(layers))) - set(residency.dense)
        ):
            return None
        keys = [(layer, e) for layer, lw in enumerate(layers) for e in range(len(lw.experts))]
        try:
            spans = [self._spans.get(k) or HostSpan.of(layers[k[0]].experts[k[1]].tensors()) for k in keys]
        except FlowmoeError:  # not packed in an arena: no span to land
            return None
        if not spans:
            return None
        first = spans[0]
        shapes = {tuple((t.shape, t.dtype) for t in layers[k[0]].experts[k[1]].tensors()) for k in keys}
        if (
            len(shapes) > 1
            or any(s.nbytes != first.nbytes or s.offsets != first.offsets for s in spans)
            or any(self._size(*k) != first.nbytes for k in keys)
            or first.nbytes % 16
        ):
            return None
        self._spans.update(zip(keys, spans, strict=True))
        slots = len(residency.experts) + buffer_bytes // first.nbytes
        return ExpertSlots.make(self.devices.gpu, slots, first.nbytes)

    def pooled(self, layer: int, expert: int) -> bool:
        """Whether the expert's copy lies in a slot of the pool (one read: atomic)."""
        return (layer, expert) in self._slots

    def layer(self, layer: int) -> LayerWeights:
        lw = self._dense.get(layer)  # one dict read: atomic while another lane changes the dict
        if lw is None:
            raise NotResident(f"the dense weights of layer {layer} are not resident on the GPU")
        return lw

    def expert(self, layer: int, expert: int) -> FFNWeights:
        ffn = self._experts.get((layer, expert))
        if ffn is None:
            raise NotResident(f"expert {expert} of layer {layer} is not resident on the GPU")
        if not isinstance(ffn, QuantizedExpert):
            return ffn
        return self._dequantized((layer, expert), ffn) if self.devices.copies else ffn.as_ffn()

    def _dequantized(self, key: tuple[int, int], packed: QuantizedExpert) -> FFNWeights:
        """A packed expert's first use since it arrived: dequantized on the current stream (the using
        lane's, ordered after the copy by its node's wait on the copy's event) and kept in its place.
        Its packed bytes, allocated on the copy stream, are marked as read by this stream before they
        are let go, so the copy stream's next expert does not land in them while the dequantization
        still reads them (record_stream)."""
        ffn = packed.to_ffn()
        if self.devices.cuda:
            stream = cuda.current_stream(self.devices.gpu)
            for tensor in packed.tensors():
                tensor.record_stream(stream)
        with self._lock:
            if self._experts.get(key) is packed:  # not evicted meanwhile
                self._experts[key] = ffn
        return ffn

    def close(self) -> None:
        """Drop every weight held on the device and this object's entry in the process's ledger."""
        with self._lock:
            self._dense.clear()
            self._experts.clear()
            self._partial.clear()
            self._spans.clear()
            self._slots.clear()
            if self._pool is not None:  # its grouped views hold it, in a cycle gc cannot see (C++)
                self._pool.pool.__dict__.pop("grouped_views", None)
            self._pool = None
            self.embed = self.head = None
            self._bytes = 0
        if self._release is not None:
            self._release()
            self._release = None

    @property
    def resident_experts(self) -> int:
        return len(self._experts)

    @property
    def nbytes(self) -> int:
        """Bytes of layer weights held on the GPU (dense parts, experts, experts partly copied)."""
        return self._bytes
