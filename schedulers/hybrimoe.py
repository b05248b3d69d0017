"""`hybrimoe`: HybriMoE's hybrid CPU/GPU scheduling and cache (Zhong et al., arXiv 2504.05897, DAC '25;
code PKU-SEC-Lab/HybriMoE, built on KTransformers).

Cache: each MoE layer owns `expert_cache_slots` / (MoE layers) GPU slots (the
code's per-layer `load_size`; without `expert_cache_slots`, `weights_gpu_share`
of all experts), filled at start with the layer's most popular experts (the
routing profile's, else the lowest ids). Attention, routers, shared experts
and the KV cache stay on the GPU, as in KTransformers.

Dynamic intra-layer scheduling (the paper's hybrid scheduling; the code's
`HSS`): after a micro-batch's gate, its routed experts are ordered cached
first, then uncached, each group by tokens, most first. The GPU takes experts
from the front (a cached one costs its FFN; an uncached one its FFN after its
copy, copies queued one after another on the link), the CPU from the back (the
fewest tokens first; its first expert also pays the activations' round trip),
each time to whichever device would finish sooner, until none is left. All
times are the context's cost function (a hardware preset's roofline or a
`flowmoe calibrate` profile), where the code uses fitted linear models.

Minus Recent Score (MRS, the code's `KScoreAwareCache`): every (layer, expert)
has a priority S; after each gate, S <- a s + (1 - a) S for the routed experts
(s: the expert's share of the micro-batch's routing) and S <- (1 - a) S for
the others, a = 0.5 (the code's default). An uncached expert the GPU takes is
copied into the layer's slots, evicting the lowest S among the experts this
micro-batch did not route to; where no slot can take it, it goes to a buffer
that serves the layer's later micro-batches and is freed when the layer ends
(the code's per-layer prefill buffer).

Impact-driven prefetch (the paper's inter-layer prefetching): once every
micro-batch of layer l has gated, the next MoE layer's routing is predicted
from its MRS scores (tokens in proportion to S), and the uncached experts whose
caching would shorten the simulated split of that layer most are copied in,
best first, while it shortens it, each into the slot of the layer's lowest S:
at most `hot_experts` (default top-k; the code's `prefetch_size`) and at most
as many as the next layer's attention hides on the link (a copy issued beyond
that would hold up the CPU experts' outputs, which share the link).

Deviations: flowmoe's routing answers carry tokens per expert, not router
probabilities, so s is the token share and the MRS top-p is the routed
experts; the code runs HSS in decode only and streams every expert to the GPU
in prefill, here HSS decides in both (with a prefill's token counts it sends
the large experts to the GPU itself); the prefetch looks one MoE layer ahead
(as the code's `prefetch_expert` does) and is capped by the link time the
next attention hides; the latencies are the cost model's, not fitted on the
machine. `--attention-on cpu` is refused, and so is `--ffn-on cpu`: HSS
places each expert itself.
"""

from __future__ import annotations

from typing import ClassVar

from attrs import frozen

from flowmoe.core.plan import ExpertCounts, Lane, Op, TaskNode
from flowmoe.core.scheduling import (
    MicroBatchShape,
    NodeFactory,
    PlanStream,
    Residency,
    Scheduler,
    SchedulerContext,
    StepShape,
    SubPlan,
)
from flowmoe.schedulers._successors import Held, cache_slots, evict_held, forget_step
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    cpu_experts,
    gate_and_route,
    gpu_attention,
    latency_model,
    model_order,
    moe_layers,
    popularity_ranking,
)
from flowmoe.schedulers.shared_options import ExpertCacheOptions, HotExpertsOptions

ALPHA = 0.5  # MRS decay: PKU-SEC-Lab/HybriMoE, KScoreAwareCache(alpha=0.5)


@frozen
class HybriMoEOptions(ExpertCacheOptions, HotExpertsOptions):
    """The cache's slots and the experts prefetched per layer (the code's `load_size` over the layers,
    and its `prefetch_size`)."""


class HybriMoEScheduler(Scheduler):
    name: ClassVar[str] = "hybrimoe"
    summary: ClassVar[str] = (
        "HybriMoE: each layer's routed experts split between CPU and GPU by a simulated schedule on the "
        "cost model; per-layer cache by Minus Recent Score; impact-driven prefetch of the next layer"
    )
    Options: ClassVar[type[HybriMoEOptions]] = HybriMoEOptions

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        spec, policy = context.spec, context.policy
        self.options = policy.options_for(self.Options)
        check_placement(self.name, policy)
        self.moe = moe_layers(spec)
        slots = cache_slots(policy, self.options.expert_cache_slots, len(self.moe), spec.moe.experts)
        share, extra = divmod(slots, len(self.moe)) if self.moe else (0, 0)
        self.quota = {m: min(spec.moe.experts, share + (i < extra)) for i, m in enumerate(self.moe)}
        ranked = popularity_ranking(spec, context.popularity)
        self.cache: dict[int, dict[int, Held]] = {m: {} for m in self.moe}
        for layer, e in ranked:
            if len(self.cache[layer]) < self.quota[layer]:
                self.cache[layer][e] = Held()
        self.initial = frozenset((m, e) for m, held in self.cache.items() for e in held)
        self.score = {m: [0.0] * spec.moe.experts for m in self.moe}
        self.prefetch = min(self.options.hot_experts or spec.moe.top_k, spec.moe.experts)
        self._cost = latency_model(context, self.name)
        probe = NodeFactory(spec)
        self._copy_seconds = self._cost(probe.node(Op.PAGE_COPY, Lane.GPU_H2D, self.moe[0] if self.moe else 0,
                                                   expert=0))  # fmt: skip
        self._gone: dict[tuple[int, int], int] = {}  # (layer, expert) -> its last EVICT in this step
        self._buffer: dict[int, Held] = {}  # the current layer's moved experts that no slot kept
        self._times: dict[tuple[int, int, int, Lane, bool], float] = {}
        self.hits = self.misses = 0

    def residency(self) -> Residency:
        return Residency(Residency.dense_only(self.context.spec).dense, self.initial)

    def weight_buffer_bytes(self) -> int:
        """Moved experts no slot kept stay in a buffer until the layer ends: one layer's experts at
        most, in a layer whose slots do not hold all of them."""
        spec = self.context.spec
        short = any(q < spec.moe.experts for q in self.quota.values())
        return spec.moe.experts * spec.expert_bytes if short else 0

    def report(self) -> dict[str, float]:
        lookups = self.hits + self.misses
        return {"hits": float(self.hits), "misses": float(self.misses),
                "hit_rate": self.hits / lookups if lookups else 0.0,
                "expert_cache_slots": float(sum(self.quota.values()))}  # fmt: skip

    def split(
        self, layer: int, mb: MicroBatchShape, counts: dict[int, int], cached: set[int]
    ) -> tuple[list[int], list[int], float]:
        """HSS over `counts` (expert -> tokens) with `cached` on the GPU: -> (experts on the CPU, experts
        on the GPU in order, the simulated finish time)."""
        by_tokens = sorted(counts, key=lambda e: (-counts[e], e))
        queue = [e for e in by_tokens if e in cached] + [e for e in by_tokens if e not in cached]
        gpu: list[int] = []
        cpu: list[int] = []
        gpu_end, cpu_end, link_end = 0.0, 0.0, 0.0
        while queue:
            first, last = queue[0], queue[-1]
            gpu_time = self._seconds(layer, mb, counts[first], Lane.GPU_COMPUTE, False)
            start = gpu_end if first in cached else max(gpu_end, link_end + self._copy_seconds)
            cpu_time = self._seconds(layer, mb, counts[last], Lane.CPU_COMPUTE, not cpu)
            if start + gpu_time <= cpu_end + cpu_time:
                if first not in cached:
                    link_end += self._copy_seconds
                gpu_end = start + gpu_time
                gpu.append(queue.pop(0))
            else:
                cpu_end += cpu_time
                cpu.append(queue.pop())
        return cpu, gpu, max(gpu_end, cpu_end)

    def _seconds(self, layer: int, mb: MicroBatchShape, tokens: int, lane: Lane, first: bool) -> float:
        """One expert's time for `tokens` tokens on `lane`; the CPU's first expert of a micro-batch also
        pays the activations' trip out and back. Memoised: HSS and the prefetch ask often."""
        key = (layer, mb.tokens, tokens, lane, first)
        seconds = self._times.get(key)
        if seconds is None:
            probe = NodeFactory(self.context.spec)
            if lane is Lane.GPU_COMPUTE:
                seconds = self._cost(probe.node(Op.EXPERT_FFN, lane, layer, mb, 0, tokens=tokens))
            else:
                nodes = cpu_experts(probe, layer, mb, 0, [(0, tokens)])
                seconds = sum(self._cost(n) for n in nodes if first or n.lane is Lane.CPU_COMPUTE)
            self._times[key] = seconds
        return seconds

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        forget_step(h for held in self.cache.values() for h in held.values())
        self._gone.clear()
        yield from model_order(f, spec, step, self._routed, lambda layer: self._layer_end(layer, step))

    def _routed(self, layer: int, mb: MicroBatchShape, post: int) -> SubPlan[list[int]]:
        gate, counts = yield from gate_and_route(self.context.factory, layer, mb, post)
        return (yield from self._experts(layer, mb, gate, counts))

    def _layer_end(self, layer: int, step: StepShape) -> PlanStream:
        """After a cached layer's last micro-batch: free its buffer, prefetch for the next layer."""
        if layer in self.cache:
            yield from self._release(layer)
            yield from self._prefetch(layer, step)

    def _release(self, layer: int) -> PlanStream:
        """The layer's buffer (moved experts no slot kept) freed after their last use."""
        for e, held in sorted(self._buffer.items()):
            evict = evict_held(self.context.factory, layer, e, held, Lane.GPU_COMPUTE)
            self._gone[(layer, e)] = evict.id
            yield evict
        self._buffer.clear()
        return None

    def _learn(self, layer: int, counts: ExpertCounts) -> None:
        """MRS: routed experts move toward their share of the routing, the others decay."""
        routed, total = dict(counts.counts), max(1, sum(n for _, n in counts.counts))
        row = self.score[layer]
        for e in range(len(row)):
            row[e] = ALPHA * routed[e] / total + (1 - ALPHA) * row[e] if e in routed else (1 - ALPHA) * row[e]

    def _admit(self, layer: int, expert: int, busy: set[int]) -> PlanStream:
        """Copy `expert` into the layer's slots, evicting the lowest score outside `busy` if full."""
        f, cached = self.context.factory, self.cache[layer]
        if len(cached) >= self.quota[layer]:
            victims = [e for e in cached if e not in busy]
            if not victims:
                return None
            victim = min(victims, key=lambda e: (self.score[layer][e], e))
            evict = evict_held(f, layer, victim, cached.pop(victim))
            self._gone[(layer, victim)] = evict.id
            yield evict
        copy = self._copy(layer, expert)
        yield copy
        cached[expert] = Held(copy.id)
        return None

    def _copy(self, layer: int, expert: int) -> TaskNode:
        """PAGE_COPY, after this step's earlier eviction of the same expert if any."""
        return self.context.factory.node(
            Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=expert, deps=[self._gone.get((layer, expert))]
        )

    def _experts(
        self, layer: int, mb: MicroBatchShape, gate: int, counts: ExpertCounts
    ) -> SubPlan[list[int]]:
        """HSS's split: moved experts copied (into a slot, else the layer's buffer), the CPU experts, then
        the GPU ones in HSS's order. -> the outputs' last nodes."""
        f, cached, buffer = self.context.factory, self.cache[layer], self._buffer
        self._learn(layer, counts)
        routed = dict(counts.counts)
        self.hits += sum(1 for e in routed if e in cached)
        self.misses += sum(1 for e in routed if e not in cached)
        on_cpu, on_gpu, _ = self.split(layer, mb, routed, {*cached, *buffer})
        for e in on_gpu:
            if e not in cached and e not in buffer:
                yield from self._admit(layer, e, set(routed))
                if e not in cached:
                    copy = self._copy(layer, e)
                    buffer[e] = Held(copy.id)
                    yield copy
        nodes = cpu_experts(f, layer, mb, gate, [(e, routed[e]) for e in sorted(on_cpu)])
        yield from nodes
        outputs = [nodes[-1].id] if nodes else []
        for e in on_gpu:
            held = cached.get(e) or buffer[e]
            ffn = f.node(
                Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=[gate, held.copy], tokens=routed[e]
            )
            held.last_use = ffn.id
            outputs.append(ffn.id)
            yield ffn
        return outputs

    def _prefetch(self, layer: int, step: StepShape) -> PlanStream:
        """Impact-driven: the next MoE layer's uncached experts whose caching shortens its predicted split."""
        position = self.moe.index(layer)
        if position + 1 >= len(self.moe):
            return None
        nxt = self.moe[position + 1]
        if not self.quota[nxt]:
            return None
        row, mb = self.score[nxt], step.micro_batches[-1]
        weight = sum(row)
        if weight <= 0:
            return None
        routed = mb.tokens * self.context.spec.moe.top_k
        predicted = {e: n for e, s in enumerate(row) if (n := round(routed * s / weight)) > 0}
        probe = NodeFactory(self.context.spec)
        hidden = sum(self._cost(n) for m in step.micro_batches for n in gpu_attention(probe, nxt, m, 0))
        for _ in range(min(self.prefetch, int(hidden // self._copy_seconds))):
            cached = set(self.cache[nxt])
            base = self.split(nxt, mb, predicted, cached)[2]
            victim = min(cached, key=lambda e: (row[e], e)) if len(cached) >= self.quota[nxt] else None
            gains = {
                e: base - self.split(nxt, mb, predicted, (cached - {victim}) | {e})[2]
                for e in predicted
                if e not in cached
            }
            best = max(gains, key=lambda e: (gains[e], -e), default=None)
            if best is None or gains[best] <= 0:
                return None
            yield from self._admit(nxt, best, {best})
        return None
