"""`pre-gated`: Pre-gated MoE (Hwang et al., ISCA 2024): experts of block N+1 chosen during block N.

In Pre-gated MoE each MoE block N carries a *pre-gate* that, from the same input
as block N's gate, selects the experts of block N+1; those experts are migrated
to the GPU while block N's experts execute, so only the activated experts (not
all of the next block's, as in "MoE-Prefetch") cross PCIe, and the copy is off
the critical path (Sec. IV-B, the pre-gate function; Sec. IV-C, the system that
overlaps expert migration of block N+1 with the execution of block N). The first
MoE block has no predecessor, so its experts are fetched on demand.

How flowmoe's variant differs from the paper's (it is speculative, the paper's
is not): in Pre-gated MoE the pre-gate is *trained* (during fine-tuning, Sec. IV-B) and
its choice is the decision: block N+1 runs exactly the experts block N's
pre-gate selected, so no expert is ever fetched on demand, and the model's
outputs are those of the fine-tuned pre-gated model, not of the original one.
Checkpoints carry no trained pre-gate, so flowmoe's PREGATE applies layer l+1's
own router to layer l's post-attention hidden state (the input of layer l's
gate) as a *prediction* (`RoutingRequest(l+1, mb, after=pregate,
speculative=True)`); layer l+1's real gate still decides, and an expert it
picks that was not predicted is fetched on demand after it. The outputs are
the original model's (every scheduler gives eager's tokens), at the price of
on-demand copies wherever the prediction misses, which the trained pre-gate
would not have (nor its effect on accuracy, Sec. VI-C). `hit_rate` measures that.

Per layer l and micro-batch: POST_ATTN, GATE of layer l, PREGATE of
layer l+1 (both on the GPU), then the expert FFNs of layer l, whose weights were
prefetched during layer l-1 where the prediction was right and are fetched on
demand (after layer l's real gate) where it was wrong; then the predicted
experts of layer l+1 are copied on `gpu.h2d`, overlapping the rest of layer l.
Here "layer l+1" is the next MoE layer: where dense layers sit between MoE
layers (every other layer in SwitchTransformer, the paper's model), MoE layer
l predicts the next MoE layer and the copy overlaps the dense layers between.

The dense part of every layer is resident. An expert brought in for a layer
(predicted for any micro-batch, or fetched on a miss) serves every micro-batch
of that layer and is evicted once the layer's last micro-batch has gated, after
the FFNs that read it (mispredicted experts nobody used right after their copy).
The buffer therefore holds at most two layers' experts: the layer computing and
the one being prefetched (2 × top-k experts at batch size 1, as in the paper; up
to every expert of both layers for a large batch).

Hit rate: for each micro-batch and layer that had a prediction (every MoE layer
after the first), `hits` counts routed experts the pre-gate predicted for that
micro-batch and `misses` the routed experts it did not; both add up over every
step the scheduler plans. `hit_rate` is hits / (hits + misses), and `report()`
returns them as a dict of floats for a front end (the CLI) to print after a run.

`--attention-on cpu` and `--ffn-on cpu` are refused: the paper computes
everything on the GPU.
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import (
    MicroBatchShape,
    PlanStream,
    Residency,
    Scheduler,
    SchedulerContext,
    StepShape,
    SubPlan,
)
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    embeddings,
    gpu_attention,
    layer_tail,
    lm_heads,
    moe_layers,
    routing_of,
    two_layers_bytes,
)


class PreGatedScheduler(Scheduler):
    name: ClassVar[str] = "pre-gated"
    summary: ClassVar[str] = (
        "Pre-gated MoE, speculative: the next layer's own router on this layer's hidden state predicts "
        "the experts to prefetch, misses fetched on demand (the paper's trained pre-gate decides instead; "
        "outputs stay the original model's)"
    )

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        check_placement(self.name, context.policy)
        self.hits = 0  # routed experts the pre-gate predicted (per layer and micro-batch)
        self.misses = 0  # routed experts it did not predict (fetched on demand, unless already in)

    @property
    def hit_rate(self) -> float:
        """Share of routed experts the pre-gate predicted; 0.0 before any prediction was checked."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def report(self) -> dict[str, float]:
        """For a front end to print after a run: `pregate_hits`, `pregate_misses` (counts, over
        every step this instance planned) and `pregate_hit_rate` (hits / (hits + misses))."""
        return {
            "pregate_hits": float(self.hits),
            "pregate_misses": float(self.misses),
            "pregate_hit_rate": self.hit_rate,
        }

    def residency(self) -> Residency:
        return Residency.dense_only(self.context.spec)

    def weight_buffer_bytes(self) -> int:
        """Two consecutive MoE layers of experts at most: the layer computing and the one prefetched."""
        spec = self.context.spec
        return two_layers_bytes([spec.layer_expert_bytes(layer) for layer in moe_layers(spec)])

    def _predicts(self, layer: int) -> int | None:
        """The MoE layer whose experts layer `layer` predicts, or None (ModelSpec.pregate_source):
        from an MoE layer the next MoE layer (block N's pre-gate selects block N + 1's experts,
        Sec. IV-B, so where dense layers sit between, as every other one in SwitchTransformer, the
        copy overlaps them too), and from the layer just before the first MoE layer, that layer."""
        spec = self.context.spec
        ahead = [m for m in range(layer + 1, spec.layers) if spec.is_moe_layer(m)]
        return ahead[0] if ahead and spec.pregate_source(ahead[0]) == layer else None

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        gpu = Lane.GPU_COMPUTE
        nodes, last = embeddings(f, step)
        yield from nodes
        # per layer, expert -> the PAGE_COPY that brings it in, and the FFNs that read it
        held: dict[int, dict[int, int]] = {layer: {} for layer in range(spec.layers)}
        readers: dict[int, dict[int, list[int]]] = {layer: {} for layer in range(spec.layers)}
        predicted: dict[tuple[int, int], frozenset[int]] = {}  # (layer, mb) -> pre-gate's experts
        for layer in range(spec.layers):
            for mb in step.micro_batches:
                attention = gpu_attention(f, layer, mb, last[mb.index])
                yield from attention
                post = attention[-1]
                gate = f.node(Op.GATE, gpu, layer, mb, deps=[post.id]) if spec.is_moe_layer(layer) else None
                target = self._predicts(layer)
                pregate = None if target is None else f.node(Op.PREGATE, gpu, target, mb, deps=[post.id])
                parts: list[int] = []
                if gate is not None:
                    yield gate
                if pregate is not None:
                    yield pregate
                if gate is not None:
                    counts = yield from routing_of(RoutingRequest(layer, mb.index, gate.id))
                    self._score(counts, predicted.pop((layer, mb.index), None))
                    parts = yield from self._experts(counts, mb, gate.id, held[layer], readers[layer])
                tail = layer_tail(f, spec, layer, mb, post.id, parts)
                yield from tail
                last[mb.index] = tail[-1].id
                if pregate is not None and target is not None:
                    guess = yield from routing_of(
                        RoutingRequest(target, mb.index, pregate.id, speculative=True)
                    )
                    experts = frozenset(guess.experts)
                    predicted[(target, mb.index)] = experts
                    yield from self._prefetch(target, sorted(experts), mb, pregate, held[target])
            yield from self._evict(layer, held.pop(layer), readers.pop(layer))
        yield from lm_heads(f, step, last)

    def _score(self, counts: ExpertCounts, guess: frozenset[int] | None) -> None:
        if guess is None:  # the first MoE layer: nothing predicted it
            return
        routed = set(counts.experts)
        self.hits += len(routed & guess)
        self.misses += len(routed - guess)

    def _experts(
        self,
        counts: ExpertCounts,
        mb: MicroBatchShape,
        gate: int,
        held: dict[int, int],
        readers: dict[int, list[int]],
    ) -> SubPlan[list[int]]:
        """FFN of each routed expert, after its prefetch, or after an on-demand copy where no
        micro-batch's prediction (and no earlier miss) brought it in. Returns the FFN ids."""
        f = self.context.factory
        ffns: list[int] = []
        for expert, tokens in counts.counts:
            if expert not in held:
                copy = f.node(Op.PAGE_COPY, Lane.GPU_H2D, counts.layer, mb, expert, deps=[gate])
                yield copy
                held[expert] = copy.id
            ffn = f.node(
                Op.EXPERT_FFN, Lane.GPU_COMPUTE, counts.layer, mb, expert, deps=[gate, held[expert]],
                tokens=tokens,
            )  # fmt: skip
            yield ffn
            readers.setdefault(expert, []).append(ffn.id)
            ffns.append(ffn.id)
        return ffns

    def _prefetch(
        self, layer: int, experts: list[int], mb: MicroBatchShape, pregate: TaskNode, held: dict[int, int]
    ) -> PlanStream:
        """Copy the predicted experts of `layer` not already on their way."""
        for expert in experts:
            if expert not in held:
                copy = self.context.factory.node(
                    Op.PAGE_COPY, Lane.GPU_H2D, layer, mb, expert, deps=[pregate.id]
                )
                yield copy
                held[expert] = copy.id
        return None

    def _evict(self, layer: int, held: dict[int, int], readers: dict[int, list[int]]) -> PlanStream:
        """Free every expert of `layer` after the FFNs that read it (or its copy, if none did)."""
        for expert in sorted(held):
            deps = readers.get(expert) or [held[expert]]
            yield self.context.factory.node(Op.EVICT, Lane.GPU_H2D, layer, expert=expert, deps=deps)
        return None
