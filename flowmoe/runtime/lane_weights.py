"""The weights a node computes with, where its lane computes: the device's copies on the GPU lanes
(resident, or copied in by the plan's PAGE_COPY nodes: NotResident where a plan forgot one), the
host's own on cpu.compute."""

from __future__ import annotations

from attrs import define

from flowmoe.core.plan import Lane, TaskNode
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.weights import FFNWeights, LayerWeights
from flowmoe.runtime.device_weights import DeviceWeights, NotResident


@define
class LaneWeights:
    """`device`: the weights on the GPU device (their residency bookkeeping too); `cuda`: that device
    is a CUDA GPU, whose copies may still be in flight on another stream."""

    model: MoEModel
    device: DeviceWeights
    cuda: bool

    def layer(self, layer: int, lane: Lane) -> LayerWeights:
        """A layer's dense weights (attention, router, shared expert) for `lane`."""
        return self.device.layer(layer) if lane.on_gpu else self.model.weights.layers[layer]

    def ffn(self, node: TaskNode, expert: int) -> FFNWeights | None:
        """`expert`'s weights for node's lane: the node's own (NotResident if missing, as ever), or
        another expert's of its layer where running it now is safe (None where it is not: on CUDA its
        copy may still be in flight; not resident)."""
        if node.lane is Lane.CPU_COMPUTE:
            return self.model.weights.layers[node.layer].expert(expert)  # packed: dequantized here
        if expert == node.expert:
            return self.device.expert(node.layer, expert)
        if self.cuda:
            return None
        try:
            return self.device.expert(node.layer, expert)
        except NotResident:
            return None
