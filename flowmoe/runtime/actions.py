"""What each task node does to real tensors: the binding of ops to model steps for one step.

StepState keeps every intermediate of a step (per layer and micro-batch) until
the step ends, so no tensor is freed while another lane or stream may still
read it. Where a tensor lives follows the lane: gpu.* lanes compute on the
GPU device, cpu.compute on the CPU; copy nodes move tensors between them.

On CUDA nothing here waits for the device on a lane's behalf except copies to
the host: a gate leaves its routing on the GPU and sends the host only its
tokens per expert, one asynchronous copy into page-locked memory and an event
(`PendingRouting`); whoever needs the routing on the host first (the driver
answering the scheduler, usually) waits for that event alone. The token layout
is uploaded once per lane and micro-batch, not once per layer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch
from attrs import Factory, define, field, frozen

from flowmoe.core.errors import FlowmoeError
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.devices.cuda import EventBook
from flowmoe.jobs.engine import StepInput
from flowmoe.kernels.kv_cache import read_kv, store_kv
from flowmoe.kernels.layout import TokenLayout
from flowmoe.kernels.router import Routing, choose, sort_by_expert, split_by_expert
from flowmoe.model.moe_model import MoEModel, Rope, expert_ranks
from flowmoe.model.weights import FFNWeights
from flowmoe.runtime.device_weights import Devices, DeviceWeights, NotResident

Key = tuple[int, int]  # (layer, micro-batch)


@frozen
class PendingRouting:
    """A gate's decision still on the GPU; `counts` [E] (page-locked) arrives when `ready` has."""

    indices: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    rows: torch.Tensor  # [T * k] token rows sorted by expert
    scales: torch.Tensor  # [T * k]
    counts: torch.Tensor  # [E] int64 on the host
    ready: torch.cuda.Event

    def resolve(self, events: EventBook) -> Routing:
        self.ready.synchronize()  # this gate's work only, not the whole stream
        counts = self.counts.tolist()
        events.release(self.ready)
        return split_by_expert(self.indices, self.weights, self.rows, self.scales, counts)


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
    routing: dict[Key, Routing | PendingRouting] = field(factory=dict)
    predicted: dict[Key, Routing | PendingRouting] = field(factory=dict)  # pre-gate predictions
    outputs: dict[Key, dict[int, torch.Tensor]] = field(factory=dict)  # expert outputs, any device
    shared: dict[Key, torch.Tensor] = field(factory=dict)
    deferred: dict[Key, frozenset[int]] = field(factory=dict)  # Expert Deferral: experts the next layer adds
    later: dict[Key, dict[int, torch.Tensor]] = field(factory=dict)  # ... and their outputs
    logits: dict[int, torch.Tensor] = field(factory=dict)
    layouts: dict[tuple[int, Lane], TokenLayout] = field(factory=dict)  # on the lane's device
    events: EventBook | None = None  # CUDA: where routing events come from
    kv_gpu: frozenset[int] = frozenset()  # layers whose KV cache lives on the GPU (the rest: on the CPU)
    cuda: bool = field(init=False, default=Factory(lambda s: s.devices.cuda, takes_self=True))  # read once
    _lock: threading.Lock = field(factory=threading.Lock)
    _x_readers: dict[Key, int] = field(factory=dict)  # pre-gates submitted, not yet run, per x they read
    _x_done: set[Key] = field(factory=set)  # x whose next layer has combined
    _ffn_bound: dict[tuple[Key, Lane], list[int]] = field(factory=dict)  # EXPERT_FFN nodes bound, not yet run
    _gates: dict[int, Key] = field(factory=dict)  # GATE node id -> its layer and micro-batch
    _batched: set[tuple[int, int, int]] = field(factory=set)  # (layer, mb, expert) a batch's GEMM has run

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
        return cls(model, {i.micro_batch: i for i in inputs}, devices, weights, events=events, kv_gpu=kv_gpu)

    # ---- routing answers for the driver

    def expert_counts(self, request: RoutingRequest) -> ExpertCounts:
        table = self.predicted if request.speculative else self.routing
        routing = self.routing_of(table, (request.layer, request.mb))
        if not request.defer:
            return ExpertCounts(request.layer, request.mb, tuple(routing.counts().items()))
        ranks = tuple(expert_ranks(routing).items())  # Expert Deferral: which experts the layer defers
        answer = ExpertCounts(request.layer, request.mb, tuple(routing.counts().items()), ranks=ranks)
        self.deferred[(request.layer, request.mb)] = frozenset(
            answer.deferrable(self.model.spec.moe.top_k - request.defer)
        )
        return answer

    def carried(self, key: Key, like: torch.Tensor) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Expert Deferral: the sum of the experts layer key deferred, for the next layer's combine
        (None where it deferred none), and the tensors that die with it."""
        later = self.deferred.pop(key, frozenset())
        if not later:
            return None, []
        outputs = self.later.pop(key, {})
        if set(outputs) != later:
            missing = sorted(later - set(outputs))
            raise FlowmoeError(
                f"combine of layer {key[0] + 1} mb {key[1]}: deferred experts {missing} never ran"
            )
        moved = {e: t.to(self.devices.gpu) for e, t in outputs.items()}
        routing = self.routing_of(self.routing, key)
        dead = [*outputs.values(), *moved.values(), self.x_cpu.pop(key, None)]
        return self.model.routed_sum(like, routing, moved, sorted(later)), dead

    def routing_of(self, table: dict[Key, Routing | PendingRouting], key: Key) -> Routing:
        """The gate's routing on the host, waiting for its counts the first time it is asked for."""
        routing = table[key]
        if isinstance(routing, PendingRouting):
            with self._lock:  # the driver and a lane thread may ask at once: one resolves it
                routing = table[key]
                if isinstance(routing, PendingRouting):
                    routing = table[key] = routing.resolve(self.events)  # type: ignore[arg-type]
        return routing

    def gate_into(
        self, table: dict[Key, Routing | PendingRouting], key: Key, x: torch.Tensor, layer: int
    ) -> None:
        """Route x [T, hidden] with layer `layer`'s router into table[key]: on the host at once without
        CUDA; on CUDA left on the GPU, its counts on their way to the host."""
        lw = self.weights.layer(layer)
        if self.events is None:
            table[key] = self.model.gate(layer, x, lw)
            return
        indices, weights = choose(x, lw.router, lw.router_bias, self.model.spec.moe, lw.selection_bias)
        rows, scales, counts = sort_by_expert(indices, weights, self.model.spec.moe.experts)
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=self.devices.cuda)
        host.copy_(counts, non_blocking=True)
        ready = self.events.take()
        ready.record()
        table[key] = PendingRouting(indices, weights, rows, scales, host, ready)

    def retire(self, tensors: Iterable[torch.Tensor]) -> None:
        """Drop tensors whose last reader was just launched on this lane: on CUDA their memory is
        reused only once this lane's stream is past that read (they may come from another stream)."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.devices.gpu)
            for tensor in tensors:
                if tensor.is_cuda:
                    tensor.record_stream(stream)

    # ---- binding

    def action(self, node: TaskNode) -> Callable[[], None]:
        """The node's work (lane threads run in inference mode: no autograd bookkeeping on any op)."""
        handler = _HANDLERS.get(node.op)
        if handler is None:
            raise FlowmoeError(f"no action for op {node.op}")
        if node.op is Op.PREGATE:  # it will read an earlier layer's x: keep that until it has
            with self._lock:
                source = (self.model.spec.pregate_source(node.layer), node.mb)
                self._x_readers[source] = self._x_readers.get(source, 0) + 1
        if node.op is Op.GATE:
            self._gates[node.id] = (node.layer, node.mb)
        if node.op is Op.EXPERT_FFN:
            batch = self.batch_of(node)
            if len(batch) > 1:  # MoE-Gen's expert over several micro-batches: one GEMM of them all
                return partial(_expert_batch, self, node, batch)
            with self._lock:
                self._ffn_bound.setdefault(((node.layer, node.mb), node.lane), []).append(node.expert)
        return partial(handler, self, node)

    def batch_of(self, node: TaskNode) -> tuple[int, ...]:
        """The micro-batches whose tokens an EXPERT_FFN node's GEMM takes, in order: its own, and
        every other one whose gate of its layer it waits for (MoE-Gen's expert over the batch)."""
        gated = {
            key[1] for d in node.deps if (key := self._gates.get(d)) is not None and key[0] == node.layer
        }
        return tuple(sorted(gated | {node.mb}))

    def release_x(self, key: Key, reader: bool) -> None:
        """x[key] (a post-attention norm) is dead once the next layer has combined and every
        pre-gate submitted to read it has run; `reader`: a pre-gate that read it is done."""
        with self._lock:
            if reader:
                self._x_readers[key] -= 1
            else:
                self._x_done.add(key)
            dead = key in self._x_done and not self._x_readers.get(key) and key in self.x
            tensor = self.x.pop(key) if dead else None
        if tensor is not None:
            self.retire([tensor])

    def _layout(self, mb: int, lane: Lane) -> TokenLayout:
        """The micro-batch's token layout with its indices where `lane` computes, uploaded once per
        lane (so the lane's own stream orders the upload before every use)."""
        key = (mb, lane)
        layout = self.layouts.get(key)
        if layout is None:
            layout, place = self.inputs[mb].layout, self._place(lane)
            if layout.positions.device != place:
                layout = layout.to(place)
            self.layouts[key] = layout
        return layout

    def _rope(self, mb: int, lane: Lane) -> Rope:
        key = (mb, str(lane))
        if key not in self.rope:
            device = self._place(lane)
            self.rope[key] = self.model.rope(self._layout(mb, lane), device)
        return self.rope[key]

    def _place(self, lane: Lane) -> torch.device:
        return self.devices.cpu if lane is Lane.CPU_COMPUTE else self.devices.gpu


def _embed(s: StepState, n: TaskNode) -> None:
    ids = s.inputs[n.mb].ids.to(s.devices.gpu, non_blocking=True)
    s.hidden[n.mb] = s.model.embed(ids, s.weights.embed)


def _pre_attn(s: StepState, n: TaskNode) -> None:
    rope = s._rope(n.mb, n.lane)
    s.qkv[(n.layer, n.mb)] = s.model.pre_attention(n.layer, s.hidden[n.mb], rope, s.weights.layer(n.layer))


def _qkv_offload(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.qkv[key] = tuple(s.devices.to_cpu(t) for t in s.qkv[key])


def _attention(s: StepState, n: TaskNode) -> None:
    step, key = s.inputs[n.mb], (n.layer, n.mb)
    q, k, v = s.qkv[key]
    lw = s.weights.layer(n.layer) if n.lane.on_gpu else s.model.weights.layers[n.layer]
    kv = s.kv_work.get(key) or step.cache.layer(n.layer)
    layout = s._layout(n.mb, n.lane) if kv[0].device == s._place(n.lane) else step.layout
    s.attn[key] = s.model.attention(n.layer, q, k, v, kv, layout, lw)


def _kv_load(s: StepState, n: TaskNode) -> None:
    """A micro-batch's cache layer (home: CPU) into a GPU working copy for GPU attention: only the
    positions this step's attention reads, up to the longest sequence after the step. Where the cache
    is split by slot (flexgen's `kv_gpu_sequences`), only the host's slots cross the link, and the
    GPU's are copied on the device in front of them (as FlexGen's mixed-device cache loads). A layer
    homed on the GPU is attended where it lives: nothing to copy."""
    if n.layer in s.kv_gpu:
        return
    step = s.inputs[n.mb]
    length = max(step.layout.advanced())
    kept, rest = step.cache.parts(n.layer)
    work = [s.devices.to_gpu(t[:, :, :length]) for t in rest]  # [slots - kept, heads, length, dim]
    if kept is not None:  # [slots, heads, length, dim]
        work = [torch.cat([ours[:, :, :length], theirs]) for ours, theirs in zip(kept, work, strict=True)]
    s.kv_work[(n.layer, n.mb)] = (work[0], work[1])


def _kv_store(s: StepState, n: TaskNode) -> None:
    """This step's new k, v from the GPU working copy back into the home cache: only the tokens of the
    host's slots cross the link where the cache is split by slot (a GPU-homed layer: attention wrote
    them there)."""
    if n.layer in s.kv_gpu:
        return
    step, key = s.inputs[n.mb], (n.layer, n.mb)
    work = s.kv_work.pop(key)  # the copy back waits for the device, so the working copy is dead after it
    store_kv(step.cache, n.layer, step.layout, *read_kv(*work, s._layout(n.mb, n.lane)))
    if s.cuda and step.cache.kept:  # the next step's KV_LOAD reads the GPU's slots on another stream
        torch.cuda.current_stream(s.devices.gpu).synchronize()
    s.retire(work)


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
    previous = s.hidden[n.mb]  # may come from another stream (ACT_LOAD): retired on this one
    s.hidden[n.mb], s.x[key] = s.model.post_attention(n.layer, previous, s.attn[key], lw)
    s.retire([previous])


def _gate(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.gate_into(s.routing, key, s.x[key], n.layer)


def _pregate(s: StepState, n: TaskNode) -> None:
    """Layer n.layer's router applied to an earlier layer's post-attention hidden state (the MoE
    layer before it, else the layer before: ModelSpec.pregate_source)."""
    source = (s.model.spec.pregate_source(n.layer), n.mb)
    s.gate_into(s.predicted, (n.layer, n.mb), s.x[source], n.layer)
    s.release_x(source, reader=True)


def _hidden_offload(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.x_cpu[key] = s.devices.to_cpu(s.x[key])


def _expert(s: StepState, n: TaskNode) -> None:
    """The node's expert, and with it in one kernel call (MoEModel.routed_experts) the other experts of
    its layer and micro-batch bound to the same lane whose weights are at hand: the host's own (the
    CPU lane, or a host without CUDA, where a resident expert is the host tensor and no copy is in
    flight). Their own nodes then find their outputs there; the rest run at their nodes. (A node that
    waits for the gates of several micro-batches is bound to `_expert_batch` instead.)"""
    key = (n.layer, n.mb)
    with s._lock:
        bound = s._ffn_bound.get((key, n.lane), [])
        if n.expert not in bound:
            return  # ran in the group of an earlier node
        ffns = {e: ffn for e in bound if (ffn := _ffn_at_hand(s, n, e)) is not None}
        s._ffn_bound[(key, n.lane)] = [e for e in bound if e not in ffns]
    outputs = s.model.routed_experts(_expert_input(s, n.lane, key), s.routing_of(s.routing, key), ffns)
    for expert, out in outputs.items():
        _keep(s, key, expert, out)


def _expert_batch(s: StepState, n: TaskNode, batch: tuple[int, ...]) -> None:
    """One GEMM of the node's expert over its tokens in every micro-batch of `batch` (MoE-Gen's
    module-based batching), run by the first of their nodes: the rows gathered in micro-batch order,
    in kernel calls of the node's rows each (the GEMM the plan prices, chunked as it is), the outputs
    split back per micro-batch; the other nodes find theirs there. A fixed order: the same floats
    every run."""
    with s._lock:
        if (n.layer, n.mb, n.expert) in s._batched:
            return  # ran in the GEMM of an earlier node
        s._batched.update((n.layer, mb, n.expert) for mb in batch)
    ffn = _ffn_at_hand(s, n, n.expert)
    routings = {key: s.routing_of(s.routing, key) for key in [(n.layer, mb) for mb in batch]}
    routed = {key: r for key, r in routings.items() if n.expert in r.tokens}  # those routed to it, in order
    inputs = [_expert_input(s, n.lane, key) for key in routed]  # [T_mb, hidden] each
    gathered = torch.cat(
        [x[r.tokens[n.expert].to(x.device)] for x, r in zip(inputs, routed.values(), strict=True)]
    )
    scales = torch.cat([r.scales[n.expert] for r in routed.values()]).to(gathered.device)[:, None]  # [N, 1]
    rows = n.rows or len(gathered)  # [N, hidden] in chunks of `rows`
    outs = [s.model.scaled_experts(chunk, weight, [len(chunk)], [ffn])[0]  # type: ignore[list-item]
            for chunk, weight in zip(gathered.split(rows), scales.split(rows), strict=True)]  # fmt: skip
    counts = [r.tokens[n.expert].numel() for r in routed.values()]
    for key, out in zip(routed, torch.cat(outs).split(counts), strict=True):
        _keep(s, key, n.expert, out)


def _expert_input(s: StepState, lane: Lane, key: Key) -> torch.Tensor:
    """The post-attention norm [T, hidden] an expert of `lane` reads: the host's copy on the CPU lane."""
    return s.x_cpu[key] if lane is Lane.CPU_COMPUTE else s.x[key]


def _keep(s: StepState, key: Key, expert: int, out: torch.Tensor) -> None:
    """An expert's output for its layer's combine (Expert Deferral's deferred ones apart, for the next)."""
    table = s.later if expert in s.deferred.get(key, ()) else s.outputs
    table.setdefault(key, {})[expert] = out


def _ffn_at_hand(s: StepState, n: TaskNode, expert: int) -> FFNWeights | None:
    """`expert`'s weights for node n's lane: the node's own (NotResident if missing, as ever), or
    another's where running it now is safe."""
    if n.lane is Lane.CPU_COMPUTE:
        return s.model.weights.layers[n.layer].experts[expert]
    if expert == n.expert:
        return s.weights.expert(n.layer, expert)
    if s.cuda:  # its copy may still be in flight on another stream
        return None
    try:
        return s.weights.expert(n.layer, expert)
    except NotResident:
        return None


def _expert_load(s: StepState, n: TaskNode) -> None:
    """A CPU expert's output to the GPU (expert -1: every output computed so far, deferred ones too)."""
    key = (n.layer, n.mb)
    if n.expert >= 0:
        outputs = s.later[key] if n.expert in s.later.get(key, {}) else s.outputs[key]
        outputs[n.expert] = s.devices.to_gpu(outputs[n.expert])
        return
    for outputs in (s.outputs.get(key, {}), s.later.get(key, {})):
        for expert in list(outputs):
            outputs[expert] = s.devices.to_gpu(outputs[expert])


def _shared(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    s.shared[key] = s.model.shared(n.layer, s.x[key], s.weights.layer(n.layer))


def _combine(s: StepState, n: TaskNode) -> None:
    key = (n.layer, n.mb)
    routing = s.routing_of(s.routing, key) if key in s.routing else None
    later = s.deferred.get(key, frozenset())  # Expert Deferral: the next layer's combine adds these
    outputs = s.outputs.get(key, {})
    if s.cuda:  # a CPU expert's output may still be on the host
        outputs = {e: t.to(s.devices.gpu) for e, t in outputs.items()}
    if routing is not None and set(outputs) != set(routing.experts) - later:
        missing = sorted(set(routing.experts) - later - set(outputs))
        raise FlowmoeError(f"combine of layer {n.layer} mb {n.mb}: experts {missing} never ran")
    previous = s.hidden[n.mb]
    carry, carried = s.carried((n.layer - 1, n.mb), previous)
    s.hidden[n.mb] = s.model.combine(previous, routing, outputs, s.shared.get(key), later, carry)
    # What only this layer's attention, experts and combine read dies here, not at the step's end;
    # x stays for the next layer's pre-gate, the previous layer's x goes once its pre-gates ran;
    # deferred experts keep their input and outputs until the next layer's combine.
    x_cpu = None if later else s.x_cpu.pop(key, None)
    dead = [s.qkv.pop(key, ()), [s.attn.pop(key, None)], s.outputs.pop(key, {}).values(), outputs.values(),
            carried, [s.shared.pop(key, None), x_cpu, previous]]  # fmt: skip
    s.retire(t for group in dead for t in group if t is not None)
    s.release_x((n.layer - 1, n.mb), reader=False)


def _page_copy(s: StepState, n: TaskNode) -> None:
    """One page: part of an expert (or a dense part), or whole experts (`n.experts`)."""
    for expert in n.experts or (n.expert,):
        s.weights.load(n.layer, expert, n.part, n.parts)


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
