"""The weights a node computes with, where its lane computes: the device's copies on the GPU lanes
(resident, or copied in by the plan's PAGE_COPY nodes: NotResident where a plan forgot one), the
host's own on cpu.compute."""

from __future__ import annotations

from attrs import define
from torch import cuda

from flowmoe.core.plan import Lane, TaskNode
from flowmoe.devices.cuda import EventBook
from flowmoe.kernels.grouped_experts import switched_on
from flowmoe.model.moe_model import MoEModel
from flowmoe.model.weights import FFNWeights, LayerWeights
from flowmoe.runtime.device_weights import DeviceWeights, NotResident


@define
class LaneWeights:
    """`device`: the weights on the GPU device (their residency bookkeeping too); `events`: the CUDA
    stream worker's (None without CUDA), where the device's copies may still be in flight on another
    stream."""

    model: MoEModel
    device: DeviceWeights
    events: EventBook | None = None

    def layer(self, layer: int, lane: Lane) -> LayerWeights:
        """A layer's dense weights (attention, router, shared expert) for `lane`."""
        return self.device.layer(layer) if lane.on_gpu else self.model.weights.layers[layer]

    def ffn(self, node: TaskNode, expert: int) -> FFNWeights:
        """`expert`'s weights for node's lane (NotResident on a GPU lane where they are not there)."""
        if node.lane is Lane.CPU_COMPUTE:
            return self.model.weights.layers[node.layer].expert(expert)  # packed: dequantized here
        return self.device.expert(node.layer, expert)

    def taken(self, node: TaskNode, other: TaskNode) -> FFNWeights | None:
        """The weights of `other`'s expert (a node of node's group, ExpertGroups) for one call at `node`:
        node's own (NotResident if missing, as ever), or the other's where running it now is safe, else
        None. Without CUDA: where it is resident (every copy is done). On CUDA: where its copy lies in
        the device's slot pool (the grouped GEMM's operand; else, or with the grouped path switched
        off, nothing is gained) and every producer of `other` that node does not wait for itself has
        been launched on a GPU lane: node's stream then waits for those on other streams
        (`wait_event`: on the device, no host wait); a producer not yet launched, or on a host lane,
        leaves `other` to its own node."""
        if other.id == node.id or node.lane is Lane.CPU_COMPUTE:
            return self.ffn(node, other.expert)
        if self.events is not None and not (switched_on() and self.device.pooled(other.layer, other.expert)):
            return None
        try:
            ffn = self.device.expert(other.layer, other.expert)
        except NotResident:
            return None
        if self.events is None:
            return ffn
        ends = [self.events.entry(dep) for dep in set(other.deps) - set(node.deps)]
        if any(entry is None for entry in ends):
            return None
        stream = cuda.current_stream()
        for entry in ends:
            assert entry is not None
            if entry[2] != stream:
                stream.wait_event(entry[1])
        return ffn
