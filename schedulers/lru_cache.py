"""`lru-cache`: a set-associative LRU expert cache on the GPU, misses computed on the CPU.

After the CPU-GPU collaborative inference design (Zhang et al. style, §3:
expert cache and CPU-GPU collaboration): the GPU holds
`expert_cache_slots` experts as an N-set, M-way (`cache_ways`) set-associative
cache; expert e of layer l maps to set (l * experts + e) mod N. An expert found
in the cache (a hit) runs on the GPU. A miss runs on the CPU next to its
weights (HIDDEN_OFFLOAD, EXPERT_FFN on cpu.compute, EXPERT_LOAD) while the
expert is fetched into its set in the background (EVICT of the least recently
used way after its last GPU use, then PAGE_COPY on h2d), so later micro-batches
and tokens hit. Lookups go micro-batch by micro-batch in model order, experts in
ascending id; the cache starts empty and lives across steps.

Without `expert_cache_slots` the cache holds `weights_gpu_share` of all experts,
rounded to whole sets (at least one set).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from attrs import define

from flowmoe.core.errors import ConfigError
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import MicroBatchShape, PlanStream, Residency, SchedulerContext, StepShape
from flowmoe.schedulers._layer_nodes import (
    cpu_experts,
    embeddings,
    gpu_attention,
    layer_tail,
    lm_heads,
    moe_layers,
)

Key = tuple[int, int]  # (layer, expert)


@define
class _Line:
    """A cached expert: the copy that brought it in, and its last GPU use, in this step (None
    once done in an earlier step: each step's plan runs on its own)."""

    copy: int | None
    last_use: int | None = None


class LRUCacheScheduler:
    name: ClassVar[str] = "lru-cache"
    summary: ClassVar[str] = (
        "set-associative LRU expert cache on the GPU; misses run on the CPU, fetched behind"
    )

    def __init__(self, context: SchedulerContext) -> None:
        self.context = context
        spec, policy = context.spec, context.policy
        self.ways = policy.cache_ways
        if self.ways < 1:
            raise ConfigError(f"cache_ways must be at least 1, got {self.ways}")
        experts = len(moe_layers(spec)) * spec.moe.experts
        slots = policy.expert_cache_slots or self.ways * max(
            1, round(policy.weights_gpu_share * experts / self.ways)
        )
        if slots % self.ways:
            raise ConfigError(f"expert_cache_slots ({slots}) must be a multiple of cache_ways ({self.ways})")
        self.slots = slots
        self.sets: list[OrderedDict[Key, _Line]] = [OrderedDict() for _ in range(slots // self.ways)]
        self.hits = 0
        self.misses = 0

    def residency(self) -> Residency:
        return Residency.dense_only(self.context.spec)

    def weight_buffer_bytes(self) -> int:
        return self.slots * self.context.spec.expert_bytes

    def kv_on_gpu(self) -> bool:
        return True

    def report(self) -> dict[str, float]:
        lookups = self.hits + self.misses
        return {"hits": float(self.hits), "misses": float(self.misses),
                "hit_rate": self.hits / lookups if lookups else 0.0}  # fmt: skip

    def set_of(self, layer: int, expert: int) -> int:
        return (layer * self.context.spec.moe.experts + expert) % len(self.sets)

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        for line in (line for ways in self.sets for line in ways.values()):
            line.copy = line.last_use = None
        nodes, last = embeddings(f, step)
        yield from nodes
        for layer in range(spec.layers):
            for mb in step.micro_batches:
                attention = gpu_attention(f, layer, mb, last[mb.index])
                yield from attention
                post, outputs, fetches = attention[-1].id, [], []
                if spec.is_moe_layer(layer):
                    gate = f.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb, deps=[post])
                    yield gate
                    counts = yield RoutingRequest(layer, mb.index, gate.id)
                    outputs, fetches = yield from self._experts(layer, mb, gate.id, counts)
                tail = layer_tail(f, spec, layer, mb, post, outputs)
                yield from tail
                yield from fetches
                last[mb.index] = tail[-1].id
        yield from lm_heads(f, step, last)

    def _experts(self, layer: int, mb: MicroBatchShape, gate: int, counts: ExpertCounts) -> PlanStream:
        """Hits on the GPU, misses on the CPU. -> (outputs' last nodes, the misses' fetch nodes, to
        emit after the micro-batch's combine so a victim's eviction never holds up its GPU lane)."""
        f, outputs, missed, fetches = self.context.factory, [], [], []
        for e, tokens in counts.counts:
            ways, key = self.sets[self.set_of(layer, e)], (layer, e)
            if key in ways:
                self.hits += 1
                ways.move_to_end(key)
                line = ways[key]
                ffn = f.node(
                    Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=[gate, line.copy], tokens=tokens
                )
                line.last_use = ffn.id
                outputs.append(ffn.id)
                yield ffn
            else:
                self.misses += 1
                missed.append((e, tokens))
                fetches += self._fetch(ways, key)
        on_cpu = cpu_experts(f, layer, mb, gate, missed)
        yield from on_cpu
        return ([*outputs, on_cpu[-1].id] if on_cpu else outputs), fetches

    def _fetch(self, ways: OrderedDict[Key, _Line], key: Key) -> list[TaskNode]:
        """Evict the set's least recently used way if it is full, copy `key` in as most recent."""
        f, nodes = self.context.factory, []
        if len(ways) >= self.ways:
            (layer, expert), victim = ways.popitem(last=False)
            deps = [victim.copy, victim.last_use]
            nodes.append(f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=expert, deps=deps))
        room = nodes[0].id if nodes else None
        copy = f.node(Op.PAGE_COPY, Lane.GPU_H2D, key[0], expert=key[1], deps=[room])
        ways[key] = _Line(copy.id)
        return [*nodes, copy]
