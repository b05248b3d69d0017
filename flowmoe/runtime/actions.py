"""What each task node does to real tensors: one step's state, and each node bound to it.

A step's state is in parts that each own one thing: the inputs where each lane computes
(`LaneInputs`), the weights where each lane computes (`LaneWeights`), the intermediates and when each
dies (`Activations`), the gates' routing (`Routings`), the expert nodes bound and not yet run
(`ExpertGroups`), and the expert outputs until the combine the plan adds them into
(`ExpertOutputs`). What an op does is in `layer_ops` and `expert_ops`; what the runtime does
differently for a scheduler (an expert GEMM over several micro-batches, an expert combined a layer
later) is read from the node, never inferred from the plan's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from attrs import Factory, define, field

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.executor import Action
from flowmoe.core.plan import ExpertCounts, Op, RoutingRequest, TaskNode
from flowmoe.devices.cuda import EventBook
from flowmoe.jobs.engine import StepInput
from flowmoe.model.moe_model import MoEModel
from flowmoe.runtime.activations import Activations
from flowmoe.runtime.device_weights import Devices, DeviceWeights
from flowmoe.runtime.expert_groups import ExpertGroups
from flowmoe.runtime.expert_ops import EXPERT_OPS, bind_expert
from flowmoe.runtime.expert_outputs import ExpertOutputs
from flowmoe.runtime.lane_inputs import LaneInputs
from flowmoe.runtime.lane_weights import LaneWeights
from flowmoe.runtime.layer_ops import LAYER_OPS, bind_pregate
from flowmoe.runtime.routings import Routings

Handler = Callable[["StepState", TaskNode], None]
Binder = Callable[["StepState", TaskNode], Action]
HANDLERS: dict[Op, Handler] = {**LAYER_OPS, **EXPERT_OPS}  # a node's work, run on its lane
BINDERS: dict[Op, Binder] = {  # ops with work to do when they are bound, before they run (no handler)
    Op.EXPERT_FFN: bind_expert,
    Op.PREGATE: bind_pregate,
}


@define
class StepState:
    model: MoEModel
    devices: Devices
    inputs: LaneInputs
    weights: LaneWeights
    acts: Activations
    routings: Routings
    groups: ExpertGroups = field(factory=ExpertGroups)
    outputs: ExpertOutputs = field(factory=ExpertOutputs)
    cuda: bool = field(init=False, default=Factory(lambda s: s.devices.cuda, takes_self=True))  # read once

    @classmethod
    def create(
        cls,
        model: MoEModel,
        inputs: Sequence[StepInput],
        devices: Devices,
        weights: DeviceWeights,
        events: EventBook | None = None,
        kv_gpu: frozenset[int] = frozenset(),
    ) -> StepState:
        """`events`: where CUDA gates take their events (None without CUDA); `kv_gpu`: the layers
        whose KV cache lives on the GPU (the rest: on the CPU)."""
        return cls(
            model,
            devices,
            LaneInputs(model, devices, {i.micro_batch: i for i in inputs}, kv_gpu),
            LaneWeights(model, weights, events),
            Activations(devices),
            Routings(model, devices, events),
        )

    def expert_counts(self, request: RoutingRequest) -> ExpertCounts:
        """The driver's answer to a routing request, from the gate's (or pre-gate's) output."""
        return self.routings.counts(request)

    def action(self, node: TaskNode) -> Action:
        """The node's work (lane threads run in inference mode: no autograd bookkeeping on any op)."""
        handler = HANDLERS.get(node.op)
        if handler is not None:
            return partial(handler, self, node)
        binder = BINDERS.get(node.op)
        if binder is None:
            raise FlowmoeError(f"no action for op {node.op}")
        return binder(self, node)
