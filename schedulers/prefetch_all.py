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

from flowmoe.core.plan import Lane, Op, RoutingRequest
from flowmoe.core.scheduling import MicroBatchShape, PlanStream, Residency, SchedulerContext, StepShape


class PrefetchAllScheduler:
    name: ClassVar[str] = "prefetch-all"
    summary: ClassVar[str] = "dense parts resident; all experts of layer l+1 copied while layer l computes"

    def __init__(self, context: SchedulerContext) -> None:
        self.context = context

    def residency(self) -> Residency:
        return Residency.dense_only(self.context.spec)

    def weight_buffer_bytes(self) -> int:
        """Two consecutive layers of experts: the layer computing and the one being copied."""
        spec = self.context.spec
        per_layer = [spec.layer_expert_bytes(layer) for layer in range(spec.layers)]
        return max(a + b for a, b in zip(per_layer, [*per_layer[1:], 0], strict=True))

    def kv_on_gpu(self) -> bool:
        return True

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        gpu = Lane.GPU_COMPUTE
        last: dict[int, int] = {}
        for mb in step.micro_batches:
            node = f.node(Op.EMBED, gpu, mb=mb)
            yield node
            last[mb.index] = node.id
        copies: dict[int, dict[int, int]] = {}  # layer -> expert -> PAGE_COPY id
        combines: dict[int, list[int]] = {}  # layer -> COMBINE ids of its micro-batches
        copies[0] = yield from self._copy_layer(0)
        for layer in range(spec.layers):
            if layer >= 1:
                yield from self._evict_layer(layer - 1, copies, combines)
            if layer + 1 < spec.layers:
                copies[layer + 1] = yield from self._copy_layer(layer + 1)
            combines[layer] = []
            for mb in step.micro_batches:
                combine = yield from self._layer(layer, mb, last[mb.index], copies[layer])
                combines[layer].append(combine)
                last[mb.index] = combine
        yield from self._evict_layer(spec.layers - 1, copies, combines)
        for mb in step.micro_batches:
            yield f.node(Op.LM_HEAD, gpu, mb=mb, deps=[last[mb.index]])

    def _copy_layer(self, layer: int) -> PlanStream:
        """PAGE_COPY of every expert of `layer` (none for a dense layer) -> {expert: copy id}."""
        spec, f = self.context.spec, self.context.factory
        out: dict[int, int] = {}
        if spec.is_moe_layer(layer):
            for expert in range(spec.moe.experts):
                copy = f.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=expert)
                yield copy
                out[expert] = copy.id
        return out

    def _evict_layer(
        self, layer: int, copies: dict[int, dict[int, int]], combines: dict[int, list[int]]
    ) -> PlanStream:
        f = self.context.factory
        for expert in copies.pop(layer, {}):
            yield f.node(Op.EVICT, Lane.GPU_H2D, layer, expert=expert, deps=combines[layer])
        return None

    def _layer(self, layer: int, mb: MicroBatchShape, before: int, copies: dict[int, int]) -> PlanStream:
        """One micro-batch through one layer; the routed experts' FFNs wait for their copies.
        Returns the COMBINE id."""
        f, spec = self.context.factory, self.context.spec
        gpu = Lane.GPU_COMPUTE
        pre = f.node(Op.PRE_ATTN, gpu, layer, mb, deps=[before])
        attn = f.node(Op.GPU_ATTN, gpu, layer, mb, deps=[pre.id])
        post = f.node(Op.POST_ATTN, gpu, layer, mb, deps=[attn.id])
        yield pre
        yield attn
        yield post
        parts: list[int] = []
        if spec.is_moe_layer(layer):
            gate = f.node(Op.GATE, gpu, layer, mb, deps=[post.id])
            yield gate
            counts = yield RoutingRequest(layer, mb.index, gate.id)
            for expert, tokens in counts.counts:
                ffn = f.node(
                    Op.EXPERT_FFN, gpu, layer, mb, expert, deps=[gate.id, copies[expert]], tokens=tokens
                )
                yield ffn
                parts.append(ffn.id)
        if not spec.is_moe_layer(layer) or spec.moe.has_shared:
            shared = f.node(Op.SHARED_FFN, gpu, layer, mb, deps=[post.id])
            yield shared
            parts.append(shared.id)
        combine = f.node(Op.COMBINE, gpu, layer, mb, deps=[post.id, *parts])
        yield combine
        return combine.id
