"""`klotski`: Klotski's expert-aware multi-batch pipeline (Fang et al., 2025, §3 and §4).

A group of n micro-batches goes through each layer together, so one copy of a
layer's experts serves all n (§3, multi-batch pipeline). Per MoE layer:

- the K hot experts were prefetched while the group's attention ran: their
  copies are issued as soon as the previous MoE layer's routing is known, the
  choice made by the correlation-aware prefetcher (§4.1): a table of which
  experts of layer l+1 follow which of layer l, seeded from the routing profile
  (`popularity`) and updated from every routing seen (the first steps are the
  warm-up). The first MoE layer's hot experts are the most popular so far;
- after each micro-batch's gate the cold experts it needs and nobody fetched
  yet are copied, in arrival order;
- the GPU computes the hot experts first for every micro-batch of the group,
  then the cold experts in arrival order, and evicts each expert after its
  last micro-batch (a hot expert nobody routed to is evicted after the gates).

The planner (§4.2) picks the smallest n for which the group's attention
(pre, attention, post, gate) covers the copy of the K hot experts, and one
expert's FFN over the group covers the copy of the next cold expert, priced by
the cost model; if no n up to the step's micro-batch count satisfies both, all
of them form one group. `group_size` in the policy overrides it. Dense parts
and `weights_gpu_share` of the experts (the most popular) stay resident; the
KV cache stays on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
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
from flowmoe.schedulers._correlation import CorrelationTable
from flowmoe.schedulers._layer_nodes import (
    embeddings,
    gpu_attention,
    kept_per_layer,
    latency_model,
    layer_tail,
    lm_heads,
    moe_layers,
)

Group = tuple[MicroBatchShape, ...]


class KlotskiScheduler:
    name: ClassVar[str] = "klotski"
    summary: ClassVar[str] = (
        "Klotski: n micro-batches per layer, hot experts prefetched by correlation and computed first"
    )

    def __init__(self, context: SchedulerContext) -> None:
        self.context = context
        spec, policy = context.spec, context.policy
        split = kept_per_layer(spec, context.popularity, policy.weights_gpu_share)
        self.moe = moe_layers(spec)
        self.resident = {m: set(kept) for m, (kept, _) in split.items()}
        offloaded = spec.moe.experts - round(policy.weights_gpu_share * spec.moe.experts)
        self.k = min(policy.hot_experts or spec.moe.top_k, offloaded)
        self.offloaded = offloaded
        self.table = CorrelationTable.seeded(self.moe, spec.moe.experts, context.popularity)
        self._cost = latency_model(context)

    def residency(self) -> Residency:
        experts = frozenset((m, e) for m, kept in self.resident.items() for e in kept)
        return Residency(Residency.dense_only(self.context.spec).dense, experts)

    def weight_buffer_bytes(self) -> int:
        """A layer's offloaded experts, plus the next layer's hot ones prefetched meanwhile."""
        return (self.offloaded + self.k) * self.context.spec.expert_bytes if self.moe else 0

    def kv_on_gpu(self) -> bool:
        return True

    def group_size(self, step: StepShape) -> int:
        """Policy's n, else the smallest n meeting the overlap constraints (all micro-batches if none)."""
        count = len(step.micro_batches)
        if self.context.policy.group_size:
            return min(self.context.policy.group_size, count)
        spec, mb = self.context.spec, step.micro_batches[0]
        probe, cost = NodeFactory(spec), self._cost
        layer = self.moe[0] if self.moe else 0
        attention = [*gpu_attention(probe, layer, mb, 0), probe.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb)]
        per_expert = max(1, -(-mb.tokens * spec.moe.top_k // spec.moe.experts))
        ffn = cost(probe.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, 0, tokens=per_expert))
        copy = cost(probe.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=0))
        attend = sum(cost(n) for n in attention)
        for n in range(1, count + 1):
            if n * attend >= self.k * copy and n * ffn >= copy:
                return n
        return count

    def plan(self, step: StepShape) -> PlanStream:
        n = self.group_size(step)
        nodes, last = embeddings(self.context.factory, step)
        yield from nodes
        mbs = step.micro_batches
        for start in range(0, len(mbs), n):
            yield from _Group(self, mbs[start : start + n], last).run()
        yield from lm_heads(self.context.factory, step, last)


class _Group:
    """One group of micro-batches through every layer."""

    def __init__(self, s: KlotskiScheduler, group: Group, last: dict[int, int]) -> None:
        self.s, self.group, self.last = s, group, last
        self.f, self.spec = s.context.factory, s.context.spec
        self.copies: dict[int, int] = {}  # expert of the current layer -> its PAGE_COPY
        self.hot: list[int] = []

    def run(self) -> PlanStream:
        routing: list[ExpertCounts] = []
        if self.s.moe:
            yield from self._prefetch(self.s.moe[0], [], None)
        for layer in range(self.spec.layers):
            posts, gates = {}, {}
            for mb in self.group:
                nodes = gpu_attention(self.f, layer, mb, self.last[mb.index])
                if self.spec.is_moe_layer(layer):
                    nodes.append(self.f.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb, deps=[nodes[-1].id]))
                    gates[mb.index] = nodes[-1].id
                posts[mb.index] = nodes[2].id
                yield from nodes
            outputs: dict[int, list[int]] = {mb.index: [] for mb in self.group}
            if self.spec.is_moe_layer(layer):
                routing = yield from self._moe(layer, gates, outputs, routing)
            for mb in self.group:
                tail = layer_tail(self.f, self.spec, layer, mb, posts[mb.index], outputs[mb.index])
                yield from tail
                self.last[mb.index] = tail[-1].id

    def _moe(
        self, layer: int, gates: dict[int, int], outputs: dict[int, list[int]], before: list[ExpertCounts]
    ) -> PlanStream:
        """Routing, cold copies in arrival order, next layer's hot prefetch, FFNs hot first. -> routing."""
        routing, hot, cold = [], self.hot, []
        resident = self.s.resident[layer]
        for mb in self.group:
            counts = yield RoutingRequest(layer, mb.index, gates[mb.index])
            routing.append(counts)
            for e in counts.experts:
                if e not in resident and e not in self.copies:
                    cold.append(e)
                    yield self._copy(layer, e, gates[mb.index])
        used = {e for counts in routing for e in counts.experts}
        for e in hot:
            if e not in used:
                yield self.f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=e, deps=[self.copies[e]])
        self.s.table.learn(before, routing)
        copies = self.copies
        position = self.s.moe.index(layer)
        if position + 1 < len(self.s.moe):
            yield from self._prefetch(self.s.moe[position + 1], routing, gates[self.group[-1].index])
        first = sorted(e for e in used if e in resident or e in hot)
        for e in first + cold:
            yield from self._ffns(layer, e, routing, gates, outputs, copies.get(e))
        return routing

    def _ffns(
        self,
        layer: int,
        expert: int,
        routing: list[ExpertCounts],
        gates: dict[int, int],
        outputs: dict[int, list[int]],
        copy: int | None,
    ) -> Iterator[TaskNode]:
        """The expert for every micro-batch of the group routed to it, then its eviction."""
        for mb, counts in zip(self.group, routing, strict=True):
            tokens = counts.tokens(expert)
            if tokens:
                deps = [gates[mb.index], copy]
                ffn = self.f.node(
                    Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, expert, deps=deps, tokens=tokens
                )
                outputs[mb.index].append(ffn.id)
                yield ffn
        if copy is not None:
            yield self.f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=expert, deps=[copy])

    def _prefetch(self, layer: int, before: list[ExpertCounts], after: int | None) -> Iterator[TaskNode]:
        """Copy the K hot experts of `layer` predicted from `before` (after node `after`)."""
        among = [e for e in range(self.spec.moe.experts) if e not in self.s.resident[layer]]
        self.hot = self.s.table.hot(layer, before, self.s.k, among)
        self.copies = {}
        for e in self.hot:
            yield self._copy(layer, e, after)

    def _copy(self, layer: int, expert: int, after: int | None) -> TaskNode:
        node = self.f.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=expert, deps=[after])
        self.copies[expert] = node.id
        return node
