"""Weights resident on the GPU: each layer's dense part and individual experts, copied in and
evicted by PAGE_COPY and EVICT nodes. Using an expert that is not resident is an error, which is
how a scheduler that forgets a copy (or evicts too early) is caught.

Without CUDA the "GPU" is the CPU and a resident copy is the CPU tensor itself.
"""

from __future__ import annotations

import torch
from attrs import define, field, fields, frozen

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.scheduling import Residency
from flowmoe.model import MoEModel
from flowmoe.weights import AttentionWeights, FFNWeights, LayerWeights


class NotResident(FlowmoeError):
    """A node used weights that are not on the GPU."""


@frozen
class Devices:
    gpu: torch.device
    cpu: torch.device = field(factory=lambda: torch.device("cpu"))

    @property
    def cuda(self) -> bool:
        return self.gpu.type == "cuda"

    @classmethod
    def detect(cls, want: str = "auto") -> Devices:
        if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
            return cls(torch.device("cpu"))
        if not torch.cuda.is_available():
            raise FlowmoeError("--device cuda asked for, but torch sees no CUDA device")
        return cls(torch.device("cuda", torch.cuda.current_device()))

    def to_gpu(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(self.gpu, non_blocking=True)

    def to_cpu(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.cpu, non_blocking=False)


def _ffn_to(devices: Devices, ffn: FFNWeights) -> FFNWeights:
    return FFNWeights(*(devices.to_gpu(t) for t in (ffn.gate_up, ffn.down, ffn.gate_up_bias, ffn.down_bias)))


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
    )


@define
class DeviceWeights:
    model: MoEModel
    devices: Devices
    _dense: dict[int, LayerWeights] = field(factory=dict)
    _experts: dict[tuple[int, int], FFNWeights] = field(factory=dict)
    embed: torch.Tensor | None = None
    head: tuple[torch.Tensor, torch.Tensor] | None = None  # final norm, lm head

    def setup(self, residency: Residency) -> None:
        """Embedding and head always live on the GPU; then what the scheduler keeps resident."""
        w = self.model.weights
        self.embed = self.devices.to_gpu(w.embed)
        self.head = (self.devices.to_gpu(w.final_norm), self.devices.to_gpu(w.lm_head))
        for layer in sorted(residency.dense):
            self.load(layer, -1)
        for layer, expert in sorted(residency.experts):
            self.load(layer, expert)

    def load(self, layer: int, expert: int) -> None:
        """PAGE_COPY: expert -1 is the layer's dense part (attention, router, shared/dense MLP)."""
        source = self.model.weights.layers[layer]
        if expert < 0:
            self._dense[layer] = _dense_to(self.devices, source)
        else:
            self._experts[(layer, expert)] = _ffn_to(self.devices, source.experts[expert])

    def evict(self, layer: int, expert: int) -> None:
        if expert < 0:
            self._dense.pop(layer, None)
        else:
            self._experts.pop((layer, expert), None)

    def layer(self, layer: int) -> LayerWeights:
        if layer not in self._dense:
            raise NotResident(f"the dense weights of layer {layer} are not resident on the GPU")
        return self._dense[layer]

    def expert(self, layer: int, expert: int) -> FFNWeights:
        if (layer, expert) not in self._experts:
            raise NotResident(f"expert {expert} of layer {layer} is not resident on the GPU")
        return self._experts[(layer, expert)]

    @property
    def resident_experts(self) -> int:
        return len(self._experts)

    @property
    def nbytes(self) -> int:
        dense = sum(lw.dense_nbytes for lw in self._dense.values())
        return dense + sum(f.nbytes for f in self._experts.values())
