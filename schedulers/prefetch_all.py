"""`prefetch-all`: the layer-ahead baseline. While layer l computes, every expert of layer l+1 is copied.

The dense part of every layer is resident; no routed expert is. Routing is not
known ahead, so the whole next layer is brought in: during layer l all experts
of layer l+1 (routed or not) are copied into the second half of a double buffer
that holds two layers of experts, so the copies overlap layer l's compute and
layer l+1's FFNs find their weights waiting. This is the "prefetch all experts
of the next layer" baseline of the expert-offloading papers ("MoE-Prefetch" in
Pre-gated MoE, Hwang et al., ISCA 2024, Sec. III): it hides the copy behind
compute at the price of moving E experts per layer where only the top-k are
used.

Per step: layer 0's experts are copied when the step starts (nothing computes
before them). A layer's experts are evicted once every micro-batch's COMBINE of
that layer is done; the EVICT nodes go on `gpu.h2d` ahead of the copies of
layer l+2, so the buffer of layer l is refilled only after layer l has read it
(and the copy stream is ordered behind that compute). Dense layers have no
experts to copy.
"""

from __future__ import annotations

from typing import ClassVar

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
    copied_experts,
    copy_experts,
    embeddings,
    evict_experts,
    gpu_attention,
    layer_tail,
    lm_heads,
    two_layers_bytes,
)


class PrefetchAllScheduler(Scheduler):
    name: ClassVar[str] = "prefetch-all"
    summary: ClassVar[str] = "dense parts resident; all experts of layer l+1 copied while layer l computes"

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        check_placement(self.name, context.policy)

    def residency(self) -> Residency:
        return Residency.dense_only(self.context.spec)

    def weight_buffer_bytes(self) -> int:
        """Two consecutive layers of experts: the layer computing and the one being copied."""
        spec = self.context.spec
        return two_layers_bytes([spec.layer_expert_bytes(layer) for layer in range(spec.layers)])

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        nodes, last = embeddings(f, step)
        yield from nodes
        copies: dict[int, dict[int, int]] = {}  # layer -> expert -> PAGE_COPY id
        combines: dict[int, list[int]] = {}  # layer -> COMBINE ids of its micro-batches
        copies[0] = yield from copy_experts(f, 0, self._experts(0))
        for layer in range(spec.layers):
            if layer >= 1:
                yield from evict_experts(f, layer - 1, copies.pop(layer - 1), combines[layer - 1])
            if layer + 1 < spec.layers:
                copies[layer + 1] = yield from copy_experts(f, layer + 1, self._experts(layer + 1))
            combines[layer] = []
            for mb in step.micro_batches:
                combine = yield from self._layer(layer, mb, last[mb.index], copies[layer])
                combines[layer].append(combine)
                last[mb.index] = combine
        yield from evict_experts(f, spec.layers - 1, copies.pop(spec.layers - 1), combines[spec.layers - 1])
        yield from lm_heads(f, step, last)

    def _experts(self, layer: int) -> range:
        """Every expert of an MoE layer (none of a dense one)."""
        spec = self.context.spec
        return range(spec.moe.experts) if spec.is_moe_layer(layer) else range(0)

    def _layer(self, layer: int, mb: MicroBatchShape, before: int, copies: dict[int, int]) -> SubPlan[int]:
        """One micro-batch through one layer; the routed experts' FFNs wait for their copies.
        Returns the COMBINE id."""
        f, spec = self.context.factory, self.context.spec
        attention = gpu_attention(f, layer, mb, before)
        yield from attention
        post = attention[-1].id
        outputs = (yield from copied_experts(f, layer, mb, post, copies)) if spec.is_moe_layer(layer) else []
        tail = layer_tail(f, spec, layer, mb, post, outputs)
        yield from tail
        return tail[-1].id
