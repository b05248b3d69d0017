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
   the link while the GPU runs the layer's attention for every micro-batch;
2. attention and gate of each micro-batch (GPU), in order;
3. once every gate has answered: the other routed experts are copied, and each
   routed expert runs once per micro-batch that routed to it, expert after
   expert (one expert's weights, every micro-batch's tokens), then is evicted;
   a prefetched expert nobody routed to is evicted after the gates;
4. the tail (shared expert, combine) of each micro-batch.

Batch sizes (the paper chooses them so that GPU computation and copies overlap):
micro-batches come as the engine forms them; what this schedule picks from the
context's cost function is `ahead`, the number of expert copies that fit in the
layer's attention time over every micro-batch (at least one), so the link
works while the GPU attends. The expert batch is always the whole step's
tokens (MoE-Gen's maximal expert batch).

Weights: `weights_gpu_share` of each layer's experts stay resident (the most
popular); the others go through a GPU buffer of one layer's experts: the i-th
copy of a layer waits for the i-th eviction of the layer before it.

Deviations: MoE-Gen offloads the whole KV cache and splits attention between
the GPU and the CPU by a ratio its planner picks; here attention and the KV
cache stay on the GPU (`--attention-on cpu` is refused), since flowmoe's CPU
attention path is CGOPipe's. The paper sizes the attention micro-batch too;
flowmoe's engine forms micro-batches before any scheduler runs. The copies
issued before the gates are a popularity guess that a large batch almost
always confirms; the paper copies a layer's experts in the same way once
nearly all of them are active.
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import (
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
        check_placement(self.name, policy)
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
        return True

    def ahead(self, layer: int, step: StepShape) -> int:
        """Copies that fit in the layer's attention and gates over every micro-batch (at least one)."""
        offloaded = len(self.order.get(layer, ()))
        if not offloaded:
            return 0
        probe, cost = NodeFactory(self.context.spec), self._cost
        attend = sum(
            cost(n)
            for mb in step.micro_batches
            for n in [*gpu_attention(probe, layer, mb, 0), probe.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb)]
        )
        copy = cost(probe.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=0))
        return max(1, min(offloaded, int(attend // copy) if copy > 0 else offloaded))

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        nodes, last = embeddings(f, step)
        yield from nodes
        freed: list[int] = []  # the previous MoE layer's EVICTs, in order: the buffer's slots
        for layer in range(spec.layers):
            moe = spec.is_moe_layer(layer)
            copies: dict[int, int] = {}
            if moe:
                for e in self.order[layer][: self.ahead(layer, step)]:
                    yield self._copy(layer, e, copies, freed)
            posts, gates = {}, {}
            for mb in step.micro_batches:
                attention = gpu_attention(f, layer, mb, last[mb.index])
                yield from attention
                posts[mb.index] = attention[-1].id
                if moe:
                    gate = f.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb, deps=[posts[mb.index]])
                    gates[mb.index] = gate.id
                    yield gate
            outputs: dict[int, list[int]] = {mb.index: [] for mb in step.micro_batches}
            if moe:
                freed = yield from self._experts(layer, step, gates, copies, freed, outputs)
            for mb in step.micro_batches:
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
