"""`fate`: Fate's cross-layer gate prefetch and shallow-favouring ARC cache (Fang et al., arXiv 2502.12224).

Cross-layer gate (Fate's key observation): the gate inputs of adjacent layers
are so similar that layer l + 1's gate applied to layer l's gate input picks
nearly the same experts as it will on its own input. In flowmoe that is the
PREGATE op (layer l + 1's router on layer l's post-attention hidden state,
see `pre-gated`): right after layer l's attention, before layer l's own gate,
it predicts layer l + 1's experts, and those not on the GPU are copied at once
(`gpu.h2d`), so the copies run while layer l gates and computes its experts.
The first MoE layer has no predecessor: its misses are fetched on demand.

Expert cache: `expert_cache_slots` S experts (without it, `weights_gpu_share`
of all experts), shallow-favouring: the MoE layers' quotas fall linearly with
depth (the i-th of n MoE layers weighs n - i), each at most the layer's
experts, the rest handed to the shallowest layers, since the shallow layers'
predictions are the weakest (the first one has none). Within a layer,
Adaptive Replacement Cache (ARC) decides which of the experts the layer used
stay: every routed expert is a reference; an expert ARC drops, a prefetched
one nobody routed to and one used but not kept are evicted after the layer's
last use of them. The cache starts empty and lives across steps.

Per layer l and micro-batch: attention; PREGATE of layer l + 1 and the copies
of its predicted experts; GATE of layer l; each routed expert on the GPU after
its copy (cached, prefetched, or fetched on demand where nothing brought it
in); the tail. After the layer: the ARC references and the evictions.

Same tokens: the prediction only moves weights; layer l + 1 runs exactly the
experts its own gate picks. `report()` gives the prediction's hits and misses
(routed experts predicted or not, over the MoE layers after the first) and the
cache's hits.

Deviations: Fate's popularity-aware INT2/INT4 quantization of the copied
experts changes outputs, so every expert crosses the link at the checkpoint's
precision; the paper favours the shallow layers because their predictions are
weaker, but the linear fall of the quotas with depth is flowmoe's choice; on
the one h2d lane, layer l + 1's prefetches go ahead of layer l's on-demand
copies issued after them (the paper reports ~97% prediction accuracy and ~99%
hits, where such misses are rare). `--attention-on cpu` and `--ffn-on cpu` are
refused (Fate computes on the GPU).
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest
from flowmoe.core.scheduling import (
    MicroBatchShape,
    PlanStream,
    Residency,
    Scheduler,
    SchedulerContext,
    StepShape,
    SubPlan,
)
from flowmoe.schedulers._successors import Arc, Held, cache_slots, evict_held, forget_step
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    embeddings,
    gpu_attention,
    layer_tail,
    lm_heads,
    moe_layers,
    routing_of,
)
from flowmoe.schedulers.shared_options import ExpertCacheOptions


def shallow_quotas(layers: list[int], slots: int, experts: int) -> dict[int, int]:
    """`slots` over `layers` in proportion to n - i (i-th of n), at most `experts` each, leftovers to
    the shallowest layers with room."""
    n = len(layers)
    weight = n * (n + 1) // 2
    quota = {m: min(experts, slots * (n - i) // weight) for i, m in enumerate(layers)} if n else {}
    left = slots - sum(quota.values())
    for m in layers:
        room = min(left, experts - quota[m])
        quota[m] += room
        left -= room
    return quota


class FateScheduler(Scheduler):
    name: ClassVar[str] = "fate"
    summary: ClassVar[str] = (
        "Fate: the next layer's router on this layer's gate input predicts its experts, copied before this "
        "layer gates; shallow-favouring ARC expert cache; misses fetched on demand"
    )
    Options: ClassVar[type[ExpertCacheOptions]] = ExpertCacheOptions

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        spec, policy = context.spec, context.policy
        self.options = policy.options_for(self.Options)
        check_placement(self.name, policy)
        self.moe = moe_layers(spec)
        slots = cache_slots(policy, self.options.expert_cache_slots, len(self.moe), spec.moe.experts)
        self.quota = shallow_quotas(self.moe, slots, spec.moe.experts)
        self.slots = slots
        self.arc = {m: Arc(self.quota[m]) for m in self.moe}
        self.held: dict[int, dict[int, Held]] = {m: {} for m in self.moe}
        self.hits = self.misses = self.cache_hits = 0

    def residency(self) -> Residency:
        return Residency.dense_only(self.context.spec)

    def weight_buffer_bytes(self) -> int:
        """The cache, plus every expert of the layer computing and of the one prefetched."""
        spec = self.context.spec
        return min(len(self.moe) * spec.moe.experts, self.slots + 2 * spec.moe.experts) * spec.expert_bytes

    def report(self) -> dict[str, float]:
        predicted = self.hits + self.misses
        return {"prediction_hits": float(self.hits), "prediction_misses": float(self.misses),
                "prediction_hit_rate": self.hits / predicted if predicted else 0.0,
                "cache_hits": float(self.cache_hits),
                "expert_cache_slots": float(sum(self.quota.values()))}  # fmt: skip

    def _next_moe(self, layer: int) -> int | None:
        spec = self.context.spec
        return layer + 1 if layer + 1 < spec.layers and spec.is_moe_layer(layer + 1) else None

    def plan(self, step: StepShape) -> PlanStream:
        f, spec, gpu = self.context.factory, self.context.spec, Lane.GPU_COMPUTE
        forget_step(h for held in self.held.values() for h in held.values())
        nodes, last = embeddings(f, step)
        yield from nodes
        predicted: dict[tuple[int, int], frozenset[int]] = {}  # (layer, mb) -> the pre-gate's experts
        for layer in range(spec.layers):
            nxt = self._next_moe(layer)
            routing: list[ExpertCounts] = []
            for mb in step.micro_batches:
                attention = gpu_attention(f, layer, mb, last[mb.index])
                yield from attention
                post = attention[-1].id
                if nxt is not None:
                    pregate = f.node(Op.PREGATE, gpu, nxt, mb, deps=[post])
                    yield pregate
                    guess = yield from routing_of(RoutingRequest(nxt, mb.index, pregate.id, speculative=True))
                    predicted[(nxt, mb.index)] = frozenset(guess.experts)
                    yield from self._copies(nxt, sorted(guess.experts), pregate.id)
                outputs: list[int] = []
                if spec.is_moe_layer(layer):
                    gate = f.node(Op.GATE, gpu, layer, mb, deps=[post])
                    yield gate
                    counts = yield from routing_of(RoutingRequest(layer, mb.index, gate.id))
                    routing.append(counts)
                    self._score(counts, predicted.pop((layer, mb.index), None))
                    outputs = yield from self._experts(layer, mb, gate.id, counts)
                tail = layer_tail(f, spec, layer, mb, post, outputs)
                yield from tail
                last[mb.index] = tail[-1].id
            if spec.is_moe_layer(layer):
                yield from self._retain(layer, routing)
        yield from lm_heads(f, step, last)

    def _score(self, counts: ExpertCounts, guess: frozenset[int] | None) -> None:
        if guess is None:
            return
        self.hits += sum(1 for e in counts.experts if e in guess)
        self.misses += sum(1 for e in counts.experts if e not in guess)

    def _copies(self, layer: int, experts: list[int], after: int) -> PlanStream:
        """Copy each expert of `layer` not on the GPU yet (after the node `after`)."""
        held = self.held[layer]
        for e in experts:
            if e not in held:
                copy = self.context.factory.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=e, deps=[after])
                held[e] = Held(copy.id)
                yield copy
        return None

    def _experts(
        self, layer: int, mb: MicroBatchShape, gate: int, counts: ExpertCounts
    ) -> SubPlan[list[int]]:
        """Each routed expert on the GPU after its copy (fetched on demand if nothing brought it in)."""
        held = self.held[layer]
        self.cache_hits += sum(1 for e in counts.experts if e in self.arc[layer].cached and e in held)
        yield from self._copies(layer, list(counts.experts), gate)
        ffns = []
        for e, n in counts.counts:
            ffn = self.context.factory.node(
                Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=[gate, held[e].copy], tokens=n
            )
            held[e].last_use = ffn.id
            ffns.append(ffn.id)
            yield ffn
        return ffns

    def _retain(self, layer: int, routing: list[ExpertCounts]) -> PlanStream:
        """ARC sees the layer's references; what it does not keep is evicted after its last use."""
        arc = self.arc[layer]
        for counts in routing:
            for e in counts.experts:
                arc.touch(e)
        keep, held = arc.cached, self.held[layer]
        for e in sorted(held):
            if e not in keep:
                yield evict_held(self.context.factory, layer, e, held.pop(e))
        return None
