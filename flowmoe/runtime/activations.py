"""A step's intermediates and when each dies.

Every intermediate is kept per micro-batch or per (layer, micro-batch) until its last reader's node
drops it (`retire`), not at the step's end, and never while another lane or stream may still read
it: the post-attention norm x of a layer lives until the next layer has combined and every pre-gate
bound to read it has run (`read_later`, `release_x`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from attrs import define, field

from flowmoe.core.plan import Lane
from flowmoe.runtime.device_weights import Devices

Key = tuple[int, int]  # (layer, micro-batch)


@define
class Activations:
    devices: Devices
    hidden: dict[int, torch.Tensor] = field(factory=dict)  # mb -> residual stream [T, hidden] (GPU)
    qkv: dict[Key, tuple[torch.Tensor, ...]] = field(factory=dict)
    kv_work: dict[Key, tuple[torch.Tensor, torch.Tensor]] = field(factory=dict)  # GPU copies of cache layers
    attn: dict[Key, torch.Tensor] = field(factory=dict)
    x: dict[Key, torch.Tensor] = field(factory=dict)  # post-attention norm [T, hidden] (GPU)
    x_cpu: dict[Key, torch.Tensor] = field(factory=dict)  # ... its host copy, for CPU experts
    shared: dict[Key, torch.Tensor] = field(factory=dict)
    logits: dict[int, torch.Tensor] = field(factory=dict)  # mb -> [sequences, vocab] on the host
    _lock: threading.Lock = field(factory=threading.Lock)
    _x_readers: dict[Key, int] = field(factory=dict)  # pre-gates bound, not yet run, per x they read
    _x_done: set[Key] = field(factory=set)  # x whose next layer has combined
    _cuda: bool = field(init=False)  # devices.cuda, read once (a device's type is a string made per read)

    @_cuda.default
    def _on_cuda(self) -> bool:
        return self.devices.cuda

    def expert_input(self, key: Key, lane: Lane) -> torch.Tensor:
        """The post-attention norm [T, hidden] an expert of `lane` reads: the host's copy on the CPU lane."""
        return self.x_cpu[key] if lane is Lane.CPU_COMPUTE else self.x[key]

    def read_later(self, key: Key) -> None:
        """A pre-gate bound to read x[key]: keep it until that pre-gate has run."""
        with self._lock:
            self._x_readers[key] = self._x_readers.get(key, 0) + 1

    def release_x(self, key: Key, reader: bool) -> None:
        """x[key] is dead once the next layer has combined and every pre-gate bound to read it has
        run; `reader`: a pre-gate that read it is done (else: the next layer has combined)."""
        with self._lock:
            if reader:
                self._x_readers[key] -= 1
            else:
                self._x_done.add(key)
            dead = key in self._x_done and not self._x_readers.get(key) and key in self.x
            tensor = self.x.pop(key) if dead else None
        if tensor is not None:
            self.retire([tensor])

    def retire(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Drop tensors whose last reader was just launched on this lane: on CUDA their memory is
        reused only once this lane's stream is past that read (they may come from another stream)."""
        if self._cuda:
            stream = torch.cuda.current_stream(self.devices.gpu)
            for tensor in tensors:
                if tensor is not None and tensor.is_cuda:
                    tensor.record_stream(stream)
