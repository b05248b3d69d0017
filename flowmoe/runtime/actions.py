"""What each task node does to real tensors: the binding of ops to model steps for one step.

StepState keeps every intermediate of a step (per layer and micro-batch) until
the step ends, so no tensor is freed while another lane or stream may still
read it. Where a tensor lives follows the lane: gpu.* lanes compute on the
GPU device, cpu.compute on the CPU; copy nodes move tensors between them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from attrs import define, field

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.jobs.engine import StepInput
from flowmoe.kernels.kv_cache import read_kv, write_kv
from flowmoe.kernels.router import Routing
from flowmoe.model.moe_model import MoEModel, Rope
from flowmoe.runtime.device_weights import Devices, DeviceWeights

Key = tuple[int, int]  # (layer, micro-batch)


@define
class StepState:
    model: MoEModel
    inputs: dict[int, StepInput]
    devices: Devices
    weights: DeviceWeights
    hidden: dict[int, torch.Tensor] = field(factory=dict)  # mb -> residual stream [T, hidden] (GPU)
    rope: dict[tuple[int, str], Rope] = field(factory=dict)  # (mb, device type) -> cos, sin
    qkv: dict[Key, tuple[torch.Tensor, ...]] = field(factory=dict)
    kv_work: dict[Key, tuple[torch.Tensor, torch.Tensor]] = field(factory=dict)  # GPU copies of cache layers
    attn: dict[Key, torch.Tensor] = field(factory=dict)
    x: dict[Key, torch.Tensor] = field(factory=dict)  # post-attention norm (GPU)
    x_cpu: dict[Key, torch.Tensor] = field(factory=dict)
    routing: dict[Key, Routing] = field(factory=dict)
    predicted: dict[Key, Routing] = field(factory=dict)  # pre-gate predictions
    outputs: dict[Key, dict[int, torch.Tensor]] = field(factory=dict)  # expert outputs, any device
    shared: dict[Key, torch.Tensor] = field(factory=dict)
    logits: dict[int, torch.Tensor] = field(factory=dict)

    @classmethod
    def create(cls, model: MoEModel, inputs: Sequence[StepInput], devices: Devices, weights: DeviceWeights):
        return cls(model, {i.micro_batch: i for i in inputs}, devices, weights)

    # ---- routing answers for the driver

    def expert_counts(self, request: RoutingRequest) -> ExpertCounts:
        table = self.predicted if request.speculative else self.routing
        routing = table[(request.layer, request.mb)]
        return ExpertCounts(request.layer, request.mb, tuple(routing.counts().items()))

    # ---- binding

    def action(self, node: TaskNode) -> Callable[[], None]:
        """The node's work, in inference mode (thread-local, so set on whichever lane thread runs it):
        no autograd bookkeeping on any op."""
        handler = _HANDLERS.get(node.op)
        if handler is None:
            raise FlowmoeError(f"no action for op {node.op}")

        def run() -> None:
            with torch.inference_mode():
                handler(self, node)

        return run

    def _rope(self, mb: int, device: torch.device) -> Rope:
        key = (mb, device.type)
        if key not in self.rope:
            self.rope[key] = self.model.rope(self.inputs[mb].layout, device)
        return self.rope[key]

    def _place(self, lane: Lane) -> torch.device:
        return self.devices.cpu if lane is Lane.CPU_COMPUTE else self.devices.gpu


def _embed(s: StepState, n: TaskNode) -> None:
    ids = s.inputs[n.mb].ids.to(s.devices.gpu, non_blocking=True)
    s.hidden[n.mb] = torch.nn.functional.embedding(ids, s.weights.embed)


def _pre_attn(s: StepState, n: TaskNode) -> None:
    rope = s._rope(n.mb, s.devices.gpu)
    s.qkv[(n.layer, n.mb)] = s.model.pre_attention(n.layer, s.hidden[n.mb], rope, s.weights.layer(n.layer))


def _qkv_offload(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.qkv[key] = tuple(s.devices.to_cpu(t) for t in s.qkv[key])


def _attention(s: StepState, n: TaskNode) -> None:
    step, key = s.inputs[n.mb], (n.layer, n.mb)
    q, k, v = s.qkv[key]
    lw = s.weights.layer(n.layer) if n.lane.on_gpu else s.model.weights.layers[n.layer]
    kv = s.kv_work.get(key) or step.cache.layer(n.layer)
    s.attn[key] = s.model.attention(n.layer, q, k, v, kv, step.layout, lw)


def _kv_load(s: StepState, n: TaskNode) -> None:
    """A micro-batch's cache layer (home: CPU) into a GPU working copy for GPU attention: only the
    positions this step's attention reads, up to the longest sequence after the step."""
    step = s.inputs[n.mb]
    length = max(step.layout.advanced())
    keys, values = (t[:, :, :length] for t in step.cache.layer(n.layer))
    s.kv_work[(n.layer, n.mb)] = (s.devices.to_gpu(keys), s.devices.to_gpu(values))


def _kv_store(s: StepState, n: TaskNode) -> None:
    """This step's new k, v from the GPU working copy back into the home cache."""
    step, key = s.inputs[n.mb], (n.layer, n.mb)
    home = step.cache.layer(n.layer)
    work = s.kv_work[key]  # kept until the step ends: the copy back may still be reading it
    if work[0] is not home[0]:
        write_kv(*home, step.layout, *read_kv(*work, step.layout))


def _hidden_load(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.attn[key] = s.devices.to_gpu(s.attn[key])


def _act_store(s: StepState, n: TaskNode) -> None:
    """A micro-batch's residual stream to the CPU between layers (FlexGen's activations on the CPU)."""
    s.hidden[n.mb] = s.devices.to_cpu(s.hidden[n.mb])


def _act_load(s: StepState, n: TaskNode) -> None:
    s.hidden[n.mb] = s.devices.to_gpu(s.hidden[n.mb])


def _post_attn(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    lw = s.weights.layer(n.layer)
    s.hidden[n.mb], s.x[key] = s.model.post_attention(n.layer, s.hidden[n.mb], s.attn[key], lw)


def _gate(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.routing[key] = s.model.gate(n.layer, s.x[key], s.weights.layer(n.layer))


def _pregate(s: StepState, n: TaskNode) -> None:
    """Layer n.layer's router applied to the previous layer's post-attention hidden state."""
    source = (n.layer - 1, n.mb)
    s.predicted[(n.layer, n.mb)] = s.model.gate(n.layer, s.x[source], s.weights.layer(n.layer))


def _hidden_offload(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.x_cpu[key] = s.devices.to_cpu(s.x[key])


def _expert(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    routing = s.routing[key]
    if n.lane is Lane.CPU_COMPUTE:
        x, ffn = s.x_cpu[key], s.model.weights.layers[n.layer].experts[n.expert]
    else:
        x, ffn = s.x[key], s.weights.expert(n.layer, n.expert)
    s.outputs.setdefault(key, {})[n.expert] = s.model.expert(x, routing, n.expert, ffn)


def _expert_load(s: StepState, n: TaskNode) -> None:
    """A CPU expert's output to the GPU (expert -1: every output computed so far)."""
    outputs = s.outputs.get((n.layer, n.mb), {})
    for expert in [n.expert] if n.expert >= 0 else list(outputs):
        outputs[expert] = s.devices.to_gpu(outputs[expert])


def _shared(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.shared[key] = s.model.shared(n.layer, s.x[key], s.weights.layer(n.layer))


def _combine(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    routing = s.routing.get(key)
    outputs = {e: t.to(s.devices.gpu) for e, t in s.outputs.get(key, {}).items()}
    if routing is not None and set(outputs) != set(routing.experts):
        missing = sorted(set(routing.experts) - set(outputs))
        raise FlowmoeError(f"combine of layer {n.layer} mb {n.mb}: experts {missing} never ran")
    s.hidden[n.mb] = s.model.combine(s.hidden[n.mb], routing, outputs, s.shared.get(key))


def _page_copy(s: StepState, n: TaskNode) -> None:
    s.weights.load(n.layer, n.expert, n.part, n.parts)


def _evict(s: StepState, n: TaskNode) -> None:
    s.weights.evict(n.layer, n.expert)


def _lm_head(s: StepState, n: TaskNode) -> None:
    rows = s.inputs[n.mb].layout.last_rows.to(s.devices.gpu)
    norm, head = s.weights.head
    s.logits[n.mb] = s.devices.to_cpu(s.model.logits(s.hidden[n.mb][rows], norm, head))


_HANDLERS: dict[Op, Callable[[StepState, TaskNode], None]] = {
    Op.EMBED: _embed,
    Op.PRE_ATTN: _pre_attn,
    Op.QKV_OFFLOAD: _qkv_offload,
    Op.CPU_ATTN: _attention,
    Op.GPU_ATTN: _attention,
    Op.HIDDEN_LOAD: _hidden_load,
    Op.ACT_STORE: _act_store,
    Op.ACT_LOAD: _act_load,
    Op.KV_LOAD: _kv_load,
    Op.KV_STORE: _kv_store,
    Op.POST_ATTN: _post_attn,
    Op.GATE: _gate,
    Op.PREGATE: _pregate,
    Op.HIDDEN_OFFLOAD: _hidden_offload,
    Op.EXPERT_FFN: _expert,
    Op.EXPERT_LOAD: _expert_load,
    Op.SHARED_FFN: _shared,
    Op.COMBINE: _combine,
    Op.PAGE_COPY: _page_copy,
    Op.EVICT: _evict,
    Op.LM_HEAD: _lm_head,
}
