"""`moe-gen`: MoE-Gen's module-based batching (Xu et al., arXiv 2503.09716, §4; code EfficientMoE/MoE-Gen).

MoE-Gen's observation: model-based batching (FlexGen, MoE-Lightning, DeepSpeed)
runs every module at the same small batch, so each expert's weights cross
PCIe for a handful of tokens. Module-based batching keeps the whole KV cache
and the accumulated tokens in host memory and runs each module at its own
batch size: attention over small micro-batches, each expert once over the
tokens of all of them, so its weights cross the link once per layer for the
whole batch (§4: module-based batching, its DAG of modules, full KV-cache
offloading; MoE-Gen(G) attends on the GPU, MoE-Gen(H) on the CPU).

Per layer, in flowmoe's nodes, for each expert group (below):

1. attention of each micro-batch (MoE-Gen's attention micro-batch), the KV
   cache's home always host memory (`kv_on_gpu` False):
   - on the GPU (MoE-Gen(G), the released code's attention mode 1): the
     micro-batch's slice of the cache layer crosses h2d (KV_LOAD) into one of
     `KV_BUFFERS` GPU KV buffers (the released config's num_k_buffer =
     num_v_buffer = 3: the i-th load waits for the (i - 3)-th KV_STORE), the
     GPU attends, this step's k, v go back (KV_STORE, d2h);
   - with `--attention-on cpu` (MoE-Gen(H), attention mode 0): q, k, v go to
     the CPU, the CPU attends next to the cache, the outputs come back;
   then each micro-batch's gate. The copies of the layer's first `ahead`
   experts (most popular first, by the routing profile, else by id) are issued
   in shares behind each micro-batch's KV slice or attention output, so they
   cross the link while attention runs;
2. once every gate of the group has answered: the other routed experts are
   copied, and each routed expert runs once over the group's tokens (one GEMM
   per expert, chunked at `EXPERT_ROWS` rows as the released code bounds it),
   expert after expert, then is evicted; a prefetched expert nobody routed to
   is evicted after the gates. The GEMM is one EXPERT_FFN node per micro-batch
   routed to the expert (so each micro-batch's combine waits for its own),
   each waiting for every gate of the group and priced at the GEMM's rows,
   the weights read by the first; each names the micro-batches the GEMM
   serves (`TaskNode.serves`), so a real run launches the GEMM at the first
   of them, over the group's tokens in micro-batch order and in chunks of
   those rows, and the others wait for it and find their outputs done;
3. the tail (shared expert, combine) of each micro-batch.

Dense parts (`--stream-dense 1`, the default): MoE-Gen's released code keeps no layer's attention or
shared expert on the GPU. Its parameter server lists every layer's attention ("attn_<layer>") and
every MoE layer's shared expert ("shared_expert_<layer>") as weight-copy tasks beside the routed
experts (moe_gen/models/deepseek/deepseek_parameter_server.py lines 109-144, at EfficientMoE/MoE-Gen
f83b812; the same in deepseekv2_initializer.py lines 924-957, Mixtral_Initializer.py lines 672-689
for the attention, Qwen_Initializer.py lines 541-550), unconditionally, whatever the GPU's memory;
its GPU holds one module buffer each for them (deepseekv2_initializer.py lines 587-596:
num_{prefill,decoding}_module_buffer "attn": 1, "shared_expert": 1), and the wrappers read them from
that buffer before each forward (models/Wrapper.py lines 265-277, 479-491). Here each MoE layer's
dense part (attention, router, shared expert: the runtime moves a dense part in one piece; the router
is 0.1% of it) is one PAGE_COPY issued behind the layer before's expert copies, so it crosses the link
while that layer's experts compute, into a buffer of two dense parts (the copy waits for the EVICT of
the dense part two layers back), and is evicted after the layer's last tail. `--stream-dense 0` keeps
them resident (flowmoe's model before issue 28).

Expert groups: the expert batch is every micro-batch of the step (a decode
step's whole batch) unless its activations do not fit the GPU next to the
weights and buffers (a prefill of thousands of prompts): then consecutive
micro-batches form groups that fit, as MoE-Gen runs its prefill in MoE
micro-batches, and between layers each group's residual stream waits in host
memory (ACT_STORE, d2h; ACT_LOAD, h2d, before the next layer's attention).

Batch sizes (§4: chosen so GPU computation and the copies overlap;
`moe_gen_policy`): the batch N is the most sequences whose KV cache fits host
memory next to the host-homed weights (the released code's global batch: host
KV slots, capped by the queries at hand), no expert resident ("MoE-Gen
deliberately offloads more data to host memory", §A.1); the attention
micro-batch μ the largest whose GPU working set fits (the released code sizes
it from the GPU's memory: 400 x 544 / context sequences for Mixtral-8x7B on
24 GB). Where host memory bounds N, smaller shares of it are candidates too,
and the one whose decode step the cost model prices fastest per sequence wins:
flowmoe's engine has one micro-batch size for the prefill and the decode, so a
large N can leave the prefill's memory room for tiny micro-batches only, whose
per-node costs then bind the GPU. With the expert batch the whole batch, each
layer's expert copies are paid once for N tokens, and `ahead` (the copies that
fit in the layer's attention time, at least one) keeps the link busy while the
GPU (or the CPU) attends.

Memory (`core.memory.gpu_memory` from its answers): one layer's offloaded
experts (the expert buffer: the released config's 8 routed-expert module
buffers), two layers' streamed dense parts, the KV buffers of the largest micro-batch at its longest context
(`kv_working_bytes`, not the default two slices of one layer), the
post-attention activations of one layer for every micro-batch of the step
(flowmoe's runtime keeps them until the next layer's combine) and the expert
group's residual stream and top-k expert outputs (`gpu_working_bytes`), and
one micro-batch's working set, at the prefill and at the last decode step;
host memory holds the whole KV cache.

Deviations, each with its reason: the dense layers (DeepSeek's first_k_dense_replace) keep their
dense part resident, where MoE-Gen streams their attention and keeps their dense MLP (a dense part
moves whole, and their attention is the smaller share); the dense buffer holds two layers where
MoE-Gen has one attention and one shared-expert buffer, so that the next layer's part loads during
this layer's experts as MoE-Gen's attention does (its buffer frees after the layer's attention).
MoE-Gen can split one step's attention
between the GPU and the CPU by a ratio (its attention mode 2, `SPLIT_RATIO_W`);
here a run attends on one of them (`--attention-on`), since where attention
runs is one placement per run in flowmoe. A decode step's residual stream
stays on the GPU (N x hidden, tens of MB) rather than in host memory. The
copies issued before the gates are flowmoe's choice: a popularity guess that a
large batch almost always confirms. The sizes follow the released code's rule (largest
batch host memory holds, largest micro-batch GPU memory holds), with the
smaller batches above as the one addition, for flowmoe's single micro-batch
size (MoE-Gen sizes its prefill and decode attention micro-batches apart: 200,
and 400 x 544 / context for Mixtral-8x7B on 24 GB); the paper's own
formulation of its batch-size optimisation was not at hand in full for this
rewrite (its abstract: sizes chosen so computation and copies overlap), so its
exact objective is not reproduced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from attrs import evolve, frozen

from flowmoe.core.cost import RooflineCost
from flowmoe.core.hardware import HardwareSpec
from flowmoe.core.memory import gpu_memory, host_need, resident_bytes, step_activation_bytes
from flowmoe.core.options import option
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.policy import Place, Policy
from flowmoe.core.ranges import IntRange
from flowmoe.core.scheduling import (
    BatchShape,
    MicroBatchShape,
    NodeFactory,
    PlanStream,
    PolicyRequest,
    Residency,
    Scheduler,
    SchedulerContext,
    StepShape,
    SubPlan,
)
from flowmoe.core.spec import ModelSpec
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    kept_per_layer,
    latency_model,
    layer_tail,
    moe_layers,
    offloaded_kv_attention,
    routing_of,
    two_layers_bytes,
)

KV_BUFFERS = 3  # the released config: num_k_buffer = num_v_buffer = 3
EXPERT_ROWS = 2048  # the released config: expert_{prefill,decoding}_batch_size_upper_bound = 2048
GPU_USABLE, CPU_USABLE = 0.86, 0.8  # the headroom `flowmoe plan` leaves (policy_search)
BATCH_SHARES = (1.0, 0.8, 0.6, 0.4)  # of the host-bound batch, tried where host memory bounds it


@frozen
class MoEGenOptions:
    """Whether the MoE layers' dense parts are streamed, as MoE-Gen's released code does."""

    stream_dense: int = option(
        1, "1: each MoE layer's dense part (attention, router, shared expert) is copied in during the "
        "layer before's experts and freed after the layer, as MoE-Gen's released code streams every "
        "attention and shared expert; 0: they stay resident", IntRange(0, 1), label="dense",
    )  # fmt: skip


def streamed_layers(spec: ModelSpec, options: MoEGenOptions) -> frozenset[int]:
    """The layers whose dense part crosses the link every step: the MoE layers, where streamed."""
    return frozenset(moe_layers(spec)) if options.stream_dense else frozenset()


def moe_gen_residency(spec: ModelSpec, options: MoEGenOptions) -> Residency:
    """No expert resident; the dense parts of the layers not streamed."""
    return Residency(frozenset(range(spec.layers)) - streamed_layers(spec, options), frozenset())


def group_token_bytes(spec: ModelSpec) -> int:
    """GPU bytes a token of the expert group holds: its residual stream and its top-k expert outputs."""
    return (1 + spec.moe.top_k) * spec.hidden * spec.dtype_bytes


def kv_buffer_bytes(spec: ModelSpec, kv_tokens: int) -> int:
    """The GPU KV buffers for attention micro-batches of `kv_tokens` cached tokens: one layer each."""
    return KV_BUFFERS * kv_tokens * spec.kv_bytes_per_token // spec.layers


def expert_groups(spec: ModelSpec, step: StepShape, room: int | None) -> list[tuple[MicroBatchShape, ...]]:
    """Consecutive micro-batches whose group tokens fit `room` bytes (None: every micro-batch in one
    group); each group at least one micro-batch."""
    mbs = step.micro_batches
    if room is None:
        return [mbs]
    per_token, tokens = group_token_bytes(spec), 0
    groups: list[tuple[MicroBatchShape, ...]] = []
    current: list[MicroBatchShape] = []
    for mb in mbs:
        if current and (tokens + mb.tokens) * per_token > room:
            groups.append(tuple(current))
            current, tokens = [], 0
        current.append(mb)
        tokens += mb.tokens
    return [*groups, tuple(current)]


class MoEGenScheduler(Scheduler):
    name: ClassVar[str] = "moe-gen"
    summary: ClassVar[str] = (
        "MoE-Gen module-based batching: KV cache and tokens in host memory, attention per micro-batch "
        "(KV slices copied in, or on the CPU), then each expert once over the whole batch's tokens"
    )
    Options: ClassVar[type[MoEGenOptions]] = MoEGenOptions

    @classmethod
    def own_policies(cls, request: PolicyRequest) -> list[Policy]:
        """MoE-Gen's batch sizes per placement (`moe_gen_policy`: the batch host memory holds the KV
        cache of, the attention micro-batch the GPU holds), for prompts padded to the longest, as
        MoE-Gen runs them (§5.1): the engine sizes each cache so."""
        r, work = request, request.workload
        return [moe_gen_policy(r.spec, r.hardware, work.prompt.maximum, work.gen_len, where, r.max_batch,
                               r.gpu_memory) for where in r.attention]  # fmt: skip

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        spec, policy = context.spec, context.policy
        check_placement(self.name, policy, attention=("gpu", "cpu"))
        self.cpu_attention = policy.attention_on == "cpu"
        self.options = policy.options_for(self.Options)
        self.streamed = streamed_layers(spec, self.options)
        split = kept_per_layer(spec, context.popularity, policy.weights_gpu_share)
        self.resident = {m: frozenset(kept) for m, (kept, _) in split.items()}
        self.order = {m: rest for m, (_, rest) in split.items()}  # offloaded, most popular first
        self._cost = latency_model(context, self.name)

    def residency(self) -> Residency:
        experts = frozenset((m, e) for m, kept in self.resident.items() for e in kept)
        return Residency(moe_gen_residency(self.context.spec, self.options).dense, experts)

    def weight_buffer_bytes(self) -> int:
        """One layer's offloaded experts and two layers' streamed dense parts."""
        spec = self.context.spec
        widest = max((len(rest) for rest in self.order.values()), default=0)
        dense = [spec.layer_dense_bytes(m) if m in self.streamed else 0 for m in range(spec.layers)]
        return widest * spec.expert_bytes + two_layers_bytes(dense)

    def kv_on_gpu(self) -> bool:
        return False

    def kv_working_bytes(self, batch: BatchShape, step: StepShape) -> int:
        """The GPU KV buffers of `step`, KV_BUFFERS slices (not the default two)."""
        return self._kv_buffers(step)

    def _kv_buffers(self, step: StepShape) -> int:
        """The KV buffers at the step's largest micro-batch context (none with the attention on the
        CPU): KV_BUFFERS micro-batches' slices of one layer."""
        kv_tokens = max(mb.kv_tokens for mb in step.micro_batches)
        return 0 if self.cpu_attention else kv_buffer_bytes(self.context.spec, kv_tokens)

    # ---- memory

    def _extra_bytes(self, step: StepShape) -> int:
        """The KV buffers (GPU attention), and one layer's post-attention activations of every
        micro-batch of the step."""
        spec = self.context.spec
        return self._kv_buffers(step) + step.tokens * spec.hidden * spec.dtype_bytes

    def groups(self, step: StepShape) -> list[tuple[MicroBatchShape, ...]]:
        """The step's expert groups: as many micro-batches as the GPU's budget leaves room for next to
        the weights, the buffers and one micro-batch's working set (no budget: all of them)."""
        spec, budget = self.context.spec, self.context.policy.gpu_memory
        if budget is None:
            return expert_groups(spec, step, None)
        fixed = (resident_bytes(spec, self.residency()) + self.weight_buffer_bytes() + self._extra_bytes(step)
                 + step_activation_bytes(spec, step))  # fmt: skip
        return expert_groups(spec, step, budget - fixed)

    def gpu_working_bytes(self, step: StepShape) -> int:
        """GPU bytes of the step beyond the resident weights, the expert buffer, the KV buffers and
        one micro-batch's activations (which the memory check counts itself): one layer's
        post-attention activations of the step, the largest expert group's tokens."""
        spec = self.context.spec
        group = max(sum(mb.tokens for mb in g) for g in self.groups(step))
        return step.tokens * spec.hidden * spec.dtype_bytes + group * group_token_bytes(spec)

    # ---- the plan

    def ahead(self, layer: int, attention: Sequence[TaskNode]) -> int:
        """Copies that fit in the group's attention (at least one): the attending lane's time, less
        what the KV slices take of the link."""
        offloaded = len(self.order.get(layer, ()))
        if not offloaded:
            return 0
        cost, lane = self._cost, Lane.CPU_COMPUTE if self.cpu_attention else Lane.GPU_COMPUTE
        attend = sum(cost(n) for n in attention if n.lane is lane)
        kv = sum(cost(n) for n in attention if n.op is Op.KV_LOAD)
        probe = NodeFactory(self.context.spec, expert_format=self.context.factory.expert_format).node(
            Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=0
        )
        copy = cost(probe)
        return max(1, min(offloaded, int(max(0.0, attend - kv) // copy) if copy > 0 else offloaded))

    def _attention(
        self, layer: int, mb: MicroBatchShape, after: int, kv_free: list[int], weights: int | None
    ) -> list[TaskNode]:
        """GPU attention after this micro-batch's KV slice came in (KV_LOAD, in a free KV buffer), or
        PRE_ATTN, q/k/v to the CPU, CPU_ATTN next to the cache, the output back (HIDDEN_LOAD),
        POST_ATTN; PRE_ATTN after `weights` (the dense part's copy) too. The last node is POST_ATTN."""
        f = self.context.factory
        if not self.cpu_attention:
            slot = kv_free[-KV_BUFFERS] if len(kv_free) >= KV_BUFFERS else None
            load = f.node(Op.KV_LOAD, Lane.GPU_H2D, layer, mb, deps=[slot])
            nodes = offloaded_kv_attention(f, layer, mb, after, load.id, weights)
            kv_free.append(nodes.store.id)  # the KV_STORE frees the buffer
            return [load, *nodes]
        pre = f.node(Op.PRE_ATTN, Lane.GPU_COMPUTE, layer, mb, deps=[after, weights])
        qkv = f.node(Op.QKV_OFFLOAD, Lane.GPU_D2H, layer, mb, deps=[pre.id])
        attn = f.node(Op.CPU_ATTN, Lane.CPU_COMPUTE, layer, mb, deps=[qkv.id])
        load = f.node(Op.HIDDEN_LOAD, Lane.GPU_H2D, layer, mb, deps=[attn.id])
        return [pre, qkv, attn, load, f.node(Op.POST_ATTN, Lane.GPU_COMPUTE, layer, mb, deps=[load.id])]

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        groups = self.groups(step)
        stored = len(groups) > 1  # residual streams wait in host memory between layers
        last: dict[int, int] = {}
        freed: list[TaskNode] = []  # the previous expert phase's EVICTs, in order: the expert buffer's slots
        kv_free: list[int] = []  # KV_STOREs, in order: the KV buffers' slots
        dense: dict[int, int] = {}  # layer -> the PAGE_COPY of its streamed dense part, then its EVICT
        if 0 in self.streamed:
            yield self._dense_copy(0, dense)
        for layer in range(spec.layers):
            moe = spec.is_moe_layer(layer)
            final = layer == spec.layers - 1
            combines: list[int] = []
            for group in groups:
                if layer == 0:
                    embeds = [f.node(Op.EMBED, Lane.GPU_COMPUTE, mb=mb) for mb in group]
                    yield from embeds
                    last.update({mb.index: n.id for mb, n in zip(group, embeds, strict=True)})
                elif stored:
                    loads = [
                        f.node(Op.ACT_LOAD, Lane.GPU_H2D, layer, mb, deps=[last[mb.index]]) for mb in group
                    ]
                    yield from loads
                    last.update({mb.index: n.id for mb, n in zip(group, loads, strict=True)})
                posts, gates, copies = yield from self._attend(
                    layer, group, last, freed, kv_free, moe, dense.get(layer)
                )
                outputs: dict[int, list[int]] = {mb.index: [] for mb in group}
                if moe:
                    freed = yield from self._experts(layer, group, gates, copies, freed, outputs)
                if group is groups[-1] and layer + 1 in self.streamed:  # behind this layer's expert copies
                    yield self._dense_copy(layer + 1, dense)
                for mb in group:
                    tail = layer_tail(f, spec, layer, mb, posts[mb.index], outputs[mb.index])
                    yield from tail
                    last[mb.index] = tail[-1].id
                    combines.append(tail[-1].id)
                    if final:
                        yield f.node(Op.LM_HEAD, Lane.GPU_COMPUTE, mb=mb, deps=[last[mb.index]])
                    elif stored:
                        store = f.node(Op.ACT_STORE, Lane.GPU_D2H, layer, mb, deps=[last[mb.index]])
                        yield store
                        last[mb.index] = store.id
            if layer in self.streamed:
                evict = f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, deps=combines)
                dense[layer] = evict.id
                yield evict

    def _dense_copy(self, layer: int, dense: dict[int, int]) -> TaskNode:
        """PAGE_COPY of the layer's dense part into the dense buffer of two layers: after the EVICT of
        the dense part two layers back (that of the layer before is still in use)."""
        node = self.context.factory.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, deps=[dense.get(layer - 2)])
        dense[layer] = node.id
        return node

    def _attend(
        self,
        layer: int,
        group: tuple[MicroBatchShape, ...],
        last: dict[int, int],
        freed: list[TaskNode],
        kv_free: list[int],
        moe: bool,
        weights: int | None,
    ) -> SubPlan[tuple[dict[int, int], dict[int, int], dict[int, int]]]:
        """Attention and gate of each micro-batch of the group (after `weights`, the copy of the
        layer's streamed dense part, if any), a share of the layer's early copies behind each one's KV
        slice (GPU) or attention output (CPU). -> (POST_ATTN ids, GATE ids, the copies issued: expert ->
        PAGE_COPY id)."""
        f = self.context.factory
        attention = {mb.index: self._attention(layer, mb, last[mb.index], kv_free, weights) for mb in group}
        copies: dict[int, int] = {}
        ahead = (
            self.order[layer][: self.ahead(layer, [n for a in attention.values() for n in a])] if moe else []
        )
        n = len(group)  # larger shares first
        chunks = [ahead[-(-len(ahead) * k // n) : -(-len(ahead) * (k + 1) // n)] for k in range(n)]
        if self.cpu_attention:  # every micro-batch's q, k, v out first, so the CPU attends back to back
            yield from (node for mb in group for node in attention[mb.index][:3])
        posts, gates = {}, {}
        for mb, chunk in zip(group, chunks, strict=True):
            nodes = attention[mb.index][3:] if self.cpu_attention else attention[mb.index]
            yield nodes.pop(0)  # the hidden load (CPU) or the KV slice (GPU), then the copies behind it
            for e in chunk:
                yield self._copy(layer, e, copies, freed)
            yield from nodes
            posts[mb.index] = nodes[-1].id
            if moe:
                gate = f.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb, deps=[posts[mb.index]])
                gates[mb.index] = gate.id
                yield gate
        return posts, gates, copies

    def _copy(self, layer: int, expert: int, copies: dict[int, int], freed: list[TaskNode]) -> TaskNode:
        """PAGE_COPY into the buffer slot the previous expert phase's matching EVICT frees, and after
        that phase's eviction of this expert where it was the same layer's (an earlier expert group)."""
        slot = len(copies)
        again = [n.id for n in freed if n.layer == layer and n.expert == expert]
        node = self.context.factory.node(
            Op.PAGE_COPY,
            Lane.GPU_H2D,
            layer,
            expert=expert,
            deps=[freed[slot].id if slot < len(freed) else None, *again],
        )
        copies[expert] = node.id
        return node

    def _experts(
        self,
        layer: int,
        group: tuple[MicroBatchShape, ...],
        gates: dict[int, int],
        copies: dict[int, int],
        freed: list[TaskNode],
        outputs: dict[int, list[int]],
    ) -> SubPlan[list[TaskNode]]:
        """The group's routing, the missing copies, then each routed expert once over the group's
        tokens. -> this phase's EVICTs, in order."""
        f = self.context.factory
        routing: list[ExpertCounts] = []
        for mb in group:
            routing.append((yield from routing_of(RoutingRequest(layer, mb.index, gates[mb.index]))))
        used = {e for counts in routing for e in counts.experts}
        evicts = []
        for e in [e for e in copies if e not in used]:  # prefetched, routed by nobody
            evict = f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=e, deps=[copies[e], *gates.values()])
            evicts.append(evict)
            yield evict
        for e in [e for e in self.order[layer] if e in used and e not in copies]:
            yield self._copy(layer, e, copies, freed)
        ranked = [e for e in self.order[layer] if e in used]
        for e in sorted(used - set(ranked)) + ranked:  # resident first, then in copy order
            ffns = self._gemm(layer, e, group, routing, [copies.get(e), *gates.values()])
            for ffn in ffns:
                outputs[ffn.mb].append(ffn.id)
            yield from ffns
            if e in copies:
                evict = f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=e, deps=[ffns[-1].id])
                evicts.append(evict)
                yield evict
        return evicts

    def _gemm(
        self,
        layer: int,
        expert: int,
        group: tuple[MicroBatchShape, ...],
        routing: Sequence[ExpertCounts],
        deps: Sequence[int | None],
    ) -> list[TaskNode]:
        """One GEMM of `expert` over the group's tokens, as one EXPERT_FFN per micro-batch that routed
        to it, each serving them all (`serves`: the first runs the GEMM, the others wait for it and
        find their outputs there): each at the GEMM rows of the whole group (up to EXPERT_ROWS), the
        weights read by the first only."""
        spec, f = self.context.spec, self.context.factory
        served = [(mb, counts.tokens(expert)) for mb, counts in zip(group, routing, strict=True)]
        served = [(mb, tokens) for mb, tokens in served if tokens]
        rows = min(EXPERT_ROWS, sum(tokens for _, tokens in served))
        weights = 3 * spec.hidden * spec.moe.intermediate * spec.dtype_bytes
        serves = [mb.index for mb, _ in served]
        nodes: list[TaskNode] = []
        for mb, tokens in served:
            after = [*deps, nodes[0].id] if nodes else deps
            node = f.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, expert, after, tokens, serves=serves)
            nodes.append(evolve(node, rows=rows, bytes=node.bytes - (weights if nodes else 0)))
        return nodes


def moe_gen_policy(
    spec: ModelSpec,
    hw: HardwareSpec,
    prompt: int,
    gen: int,
    attention_on: Place = "gpu",
    max_batch: int | None = None,
    gpu_memory: int | None = None,
) -> Policy:
    """MoE-Gen's batch sizes for sequences of `prompt` + `gen` tokens. The released code's global batch:
    the most sequences whose KV cache fits CPU_USABLE of host memory next to the host-homed weights (no
    expert resident), or `max_batch` (the queries at hand) where fewer; where host memory bounds it,
    BATCH_SHARES of that bound are candidates too. Each candidate N takes μ = ceil(N / count) for the
    fewest micro-batches whose prefill and last decode step fit GPU_USABLE of the GPU (`gpu_memory`,
    else the device's) by the scheduler's own accounting (N shrinks by a tenth while none fits); the
    candidate whose decode step the cost model prices fastest per sequence wins (§4: the sizes chosen
    so GPU computation and the copies overlap)."""
    homed = host_need(spec, moe_gen_residency(spec, MoEGenOptions()), 0).total
    most = max(1, int((CPU_USABLE * hw.cpu_memory - homed) // ((prompt + gen) * spec.kv_bytes_per_token)))
    budget = int(GPU_USABLE * (gpu_memory if gpu_memory is not None else hw.gpu_memory))
    if max_batch and max_batch <= most:
        return _sized(spec, hw, max_batch, attention_on, budget, prompt, gen, gpu_memory)
    sized = {_sized(spec, hw, max(1, round(most * share)), attention_on, budget, prompt, gen, gpu_memory)
             for share in BATCH_SHARES}  # fmt: skip
    return max(sized, key=lambda p: p.batch_size / _decode_seconds(spec, hw, p, prompt + gen // 2))


def _sized(
    spec: ModelSpec,
    hw: HardwareSpec,
    n: int,
    attention_on: Place,
    budget: int,
    prompt: int,
    gen: int,
    gpu_memory: int | None,
) -> Policy:
    """N (shrunk by a tenth while nothing fits) in the fewest micro-batches that fit `budget`."""

    def policy(count: int) -> Policy:
        return Policy(-(-n // count), count, attention_on, "gpu", weights_gpu_share=0.0, kv_gpu_share=0.0,
                      gpu_memory=gpu_memory)  # fmt: skip

    def fits(count: int) -> bool:
        return _fits(spec, hw, policy(count), budget, prompt, gen)

    while n > 1 and not fits(n):
        n = math.floor(n * 0.9)
    low, high = 1, n  # the fewest micro-batches that fit: more of them never need more memory
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid + 1, high)
    return policy(low)


def _decode_seconds(spec: ModelSpec, hw: HardwareSpec, policy: Policy, context: int) -> float:
    """A decode step at `context` tokens by the cost model: the busiest lane's total over the nodes of
    one MoE layer (the model cut after its first, routing spread evenly), times the layers."""
    layer = next(m for m in range(spec.layers) if spec.is_moe_layer(m))
    cut, cost = spec.with_layers(layer + 1), RooflineCost(hw, spec)
    sched = MoEGenScheduler(SchedulerContext(cut, policy, NodeFactory(cut), cost))
    n, mu, experts, k = policy.batch_size, policy.micro_batch_size, spec.moe.experts, spec.moe.top_k
    sizes = [min(mu, n - start) for start in range(0, n, mu)]
    step = StepShape(1, False, tuple(MicroBatchShape.from_lengths(i, [1] * s, [context] * s)
                                     for i, s in enumerate(sizes)))  # fmt: skip
    busy: dict[Lane, float] = {}
    plan, sent = sched.plan(step), None
    try:
        while True:
            item = plan.send(sent)
            sent = None
            if isinstance(item, RoutingRequest):  # tokens x top_k spread over the experts, from mb's offset
                t = sizes[item.mb] * k
                counts = [
                    t // experts + (1 if (e - item.mb) % experts < t % experts else 0) for e in range(experts)
                ]
                sent = ExpertCounts(item.layer, item.mb, tuple((e, c) for e, c in enumerate(counts) if c))
            elif item.layer == layer:
                busy[item.lane] = busy.get(item.lane, 0.0) + cost(item)
    except StopIteration:
        pass
    return max(busy.values()) * spec.layers


def _fits(spec: ModelSpec, hw: HardwareSpec, policy: Policy, budget: int, prompt: int, gen: int) -> bool:
    """The prefill and the last decode step of the policy's batch fit `budget` bytes of GPU memory."""
    context = SchedulerContext(
        spec, evolve(policy, gpu_memory=budget), NodeFactory(spec), RooflineCost(hw, spec)
    )
    mu, n = policy.micro_batch_size, policy.batch_size
    batch = BatchShape.of([prompt] * n, mu, gen)
    return gpu_memory(MoEGenScheduler(context), batch).total <= budget
