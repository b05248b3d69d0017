"""`moe-gen`: MoE-Gen's module-based batching (Xu et al., arXiv 2503.09716; code EfficientMoE/MoE-Gen).

MoE-Gen's observation: model-based batching (FlexGen, MoE-Lightning, DeepSpeed)
runs every module at the same small batch, so each expert's weights cross
PCIe for a handful of tokens. Module-based batching accumulates the tokens of
many micro-batches in host memory and runs each module at its own batch size:
attention over the (small) micro-batches, each expert once over the tokens of
all of them, so its weights cross the link once per layer and step for the
whole batch (the paper's module-based batching and its DAG of modules).

Per layer, in flowmoe's nodes:

1. the copies of the layer's first `ahead` experts (most popular first, by the
   routing profile, else by id) are issued when the layer starts, so they cross
   the link while the layer's attention runs for every micro-batch (with CPU
   attention, in shares behind each micro-batch's attention output coming back);
2. attention and gate of each micro-batch, in order: on the GPU next to a GPU
   KV cache, or with `--attention-on cpu` (MoE-Gen's full KV-cache offload and
   CPU attention) every micro-batch's q, k, v go to the CPU, the CPU attends
   next to the cache, and the outputs come back for the gate;
3. once every gate has answered: the other routed experts are copied, and each
   routed expert runs once per micro-batch that routed to it, expert after
   expert (one expert's weights, every micro-batch's tokens), then is evicted;
   a prefetched expert nobody routed to is evicted after the gates;
4. the tail (shared expert, combine) of each micro-batch.

Batch sizes (the paper chooses them so that GPU computation and copies overlap):
micro-batches come as the engine forms them; what this schedule picks from the
context's cost function is `ahead`, the number of expert copies that fit in the
layer's attention time over every micro-batch (at least one), so the link
works while the GPU (or the CPU) attends. The expert batch is always the whole step's
tokens (MoE-Gen's maximal expert batch).

Weights: `weights_gpu_share` of each layer's experts stay resident (the most
popular); the others go through a GPU buffer of one layer's experts: the i-th
copy of a layer waits for the i-th eviction of the layer before it.

Deviations: MoE-Gen splits attention between the GPU and the CPU by a ratio
its planner picks; here all of a step's attention runs on one of them
(`--attention-on`), since where the KV cache lives is one choice per run in
flowmoe. An EXPERT_FFN node serves one micro-batch (the runtime has no node
spanning micro-batches), so an expert's micro-batches run back to back from
one copy of its weights, but as one GEMM each, at the GEMM efficiency of a
micro-batch's rows rather than of the whole batch's. The paper sizes the
attention micro-batch too; flowmoe's engine forms micro-batches before any
scheduler runs. The copies issued before the gates are flowmoe's choice: a
popularity guess that a large batch almost always confirms.
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import (
    MicroBatchShape,
    NodeFactory,
    PlanStream,
    Residency,
    SchedulerContext,
    StepShape,
)
from flowmoe.schedulers._layer_nodes import (
    check_placement,
    embeddings,
    gpu_attention,
    kept_per_layer,
    latency_model,
    layer_tail,
    lm_heads,
)


class MoEGenScheduler:
    name: ClassVar[str] = "moe-gen"
    summary: ClassVar[str] = (
        "MoE-Gen module-based batching: attention per micro-batch, then each expert once over every "
        "micro-batch's tokens (one copy per layer and step); copies start during the layer's attention"
    )

    def __init__(self, context: SchedulerContext) -> None:
        self.context = context
        spec, policy = context.spec, context.policy
        check_placement(self.name, policy, attention=("gpu", "cpu"))
        self.cpu_attention = policy.attention_on == "cpu"
        split = kept_per_layer(spec, context.popularity, policy.weights_gpu_share)
        self.resident = {m: frozenset(kept) for m, (kept, _) in split.items()}
        self.order = {m: rest for m, (_, rest) in split.items()}  # offloaded, most popular first
        self._cost = latency_model(context, self.name)

    def residency(self) -> Residency:
        experts = frozenset((m, e) for m, kept in self.resident.items() for e in kept)
        return Residency(Residency.dense_only(self.context.spec).dense, experts)

    def weight_buffer_bytes(self) -> int:
        widest = max((len(rest) for rest in self.order.values()), default=0)
        return widest * self.context.spec.expert_bytes

    def kv_on_gpu(self) -> bool:
        return not self.cpu_attention

    def ahead(self, layer: int, step: StepShape) -> int:
        """Copies that fit in the layer's attention over every micro-batch (at least one): the GPU's
        attention and gates, or with CPU attention the CPU's attention."""
        offloaded = len(self.order.get(layer, ()))
        if not offloaded:
            return 0
        probe, cost = NodeFactory(self.context.spec), self._cost
        attend = sum(
            cost(n)
            for mb in step.micro_batches
            for n in self._attention(probe, layer, mb, 0)
            if n.lane is (Lane.CPU_COMPUTE if self.cpu_attention else Lane.GPU_COMPUTE)
        )
        copy = cost(probe.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=0))
        return max(1, min(offloaded, int(attend // copy) if copy > 0 else offloaded))

    def _attention(self, f: NodeFactory, layer: int, mb: MicroBatchShape, after: int) -> list[TaskNode]:
        """GPU attention with the cache on the GPU; or PRE_ATTN, q/k/v to the CPU, CPU_ATTN next to the
        cache, the output back (HIDDEN_LOAD), POST_ATTN. The last node is POST_ATTN."""
        if not self.cpu_attention:
            return gpu_attention(f, layer, mb, after)
        pre = f.node(Op.PRE_ATTN, Lane.GPU_COMPUTE, layer, mb, deps=[after])
        qkv = f.node(Op.QKV_OFFLOAD, Lane.GPU_D2H, layer, mb, deps=[pre.id])
        attn = f.node(Op.CPU_ATTN, Lane.CPU_COMPUTE, layer, mb, deps=[qkv.id])
        load = f.node(Op.HIDDEN_LOAD, Lane.GPU_H2D, layer, mb, deps=[attn.id])
        return [pre, qkv, attn, load, f.node(Op.POST_ATTN, Lane.GPU_COMPUTE, layer, mb, deps=[load.id])]

    def plan(self, step: StepShape) -> PlanStream:
        f, spec, mbs = self.context.factory, self.context.spec, step.micro_batches
        nodes, last = embeddings(f, step)
        yield from nodes
        freed: list[int] = []  # the previous MoE layer's EVICTs, in order: the buffer's slots
        for layer in range(spec.layers):
            moe = spec.is_moe_layer(layer)
            copies: dict[int, int] = {}
            ahead = self.order[layer][: self.ahead(layer, step)] if moe else []
            n = len(mbs)  # CPU attention: a share of the copies behind each hidden load, larger ones first
            chunks = [ahead[-(-len(ahead) * k // n) : -(-len(ahead) * (k + 1) // n)] for k in range(n)]
            if not self.cpu_attention:  # the copies go first, under the GPU's attention
                chunks = [ahead, *([] for _ in mbs[1:])]
            attention = {mb.index: self._attention(f, layer, mb, last[mb.index]) for mb in mbs}
            if self.cpu_attention:  # every micro-batch's q, k, v out first, so the CPU attends back to back
                yield from (n for mb in mbs for n in attention[mb.index][:3])
            posts, gates = {}, {}
            for mb, chunk in zip(mbs, chunks, strict=True):
                nodes = attention[mb.index][3:] if self.cpu_attention else attention[mb.index]
                if self.cpu_attention:  # the hidden load, then this share of the copies behind it
                    yield nodes.pop(0)
                for e in chunk:
                    yield self._copy(layer, e, copies, freed)
                yield from nodes
                posts[mb.index] = nodes[-1].id
                if moe:
                    gate = f.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb, deps=[posts[mb.index]])
                    gates[mb.index] = gate.id
                    yield gate
            outputs: dict[int, list[int]] = {mb.index: [] for mb in mbs}
            if moe:
                freed = yield from self._experts(layer, step, gates, copies, freed, outputs)
            for mb in mbs:
                tail = layer_tail(f, spec, layer, mb, posts[mb.index], outputs[mb.index])
                yield from tail
                last[mb.index] = tail[-1].id
        yield from lm_heads(f, step, last)

    def _copy(self, layer: int, expert: int, copies: dict[int, int], freed: list[int]) -> TaskNode:
        """PAGE_COPY into the buffer slot the previous layer's matching EVICT frees."""
        slot = len(copies)
        node = self.context.factory.node(
            Op.PAGE_COPY,
            Lane.GPU_H2D,
            layer,
            expert=expert,
            deps=[freed[slot] if slot < len(freed) else None],
        )
        copies[expert] = node.id
        return node

    def _experts(
        self,
        layer: int,
        step: StepShape,
        gates: dict[int, int],
        copies: dict[int, int],
        freed: list[int],
        outputs: dict[int, list[int]],
    ) -> PlanStream:
        """Every micro-batch's routing, the missing copies, then expert by expert over every micro-batch.
        -> this layer's EVICTs, in order."""
        f = self.context.factory
        routing: list[ExpertCounts] = []
        for mb in step.micro_batches:
            routing.append((yield RoutingRequest(layer, mb.index, gates[mb.index])))
        used = {e for counts in routing for e in counts.experts}
        evicts = []
        for e in [e for e in copies if e not in used]:  # prefetched, routed by nobody
            evict = f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=e, deps=[copies[e], *gates.values()])
            evicts.append(evict.id)
            yield evict
        for e in [e for e in self.order[layer] if e in used and e not in copies]:
            yield self._copy(layer, e, copies, freed)
        ranked = [e for e in self.order[layer] if e in used]
        for e in sorted(used - set(ranked)) + ranked:  # resident first, then in copy order
            ffns = []
            for mb, counts in zip(step.micro_batches, routing, strict=True):
                if counts.tokens(e):
                    deps = [gates[mb.index], copies.get(e)]
                    ffn = f.node(
                        Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=deps, tokens=counts.tokens(e)
                    )
                    outputs[mb.index].append(ffn.id)
                    ffns.append(ffn)
                    yield ffn
            if e in copies:
                evict = f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=e, deps=[ffns[-1].id])
                evicts.append(evict.id)
                yield evict
        return evicts
