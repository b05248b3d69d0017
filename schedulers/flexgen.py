"""`flexgen`: FlexGen's zig-zag block schedule (Sheng et al., ICML 2023, Sec. 4.2 and Algorithm 1).

FlexGen runs a *block* of N = μ × n sequences (n micro-batches, FlexGen's "GPU
batches", of μ sequences) column by column: layer after layer, and within a
layer over every micro-batch, so a layer's weights are loaded once per block and
reused by all its micro-batches. Algorithm 1 ("block schedule with
overlapping"), iteration (layer j, micro-batch k):

    load_weight(j + 1)     the next layer's weights (FlexGen issues them at k = 0)
    load_cache(j, k + 1)   the next micro-batch's KV cache (wrapping to layer j + 1)
    compute(j, k)
    store_cache(j, k)

Here that is: the KV cache lives on the CPU (`kv_on_gpu` False; FlexGen's cache
placement with no GPU share) and attention runs on the GPU. Each (layer,
micro-batch) gets a KV_LOAD on `gpu.h2d` issued one iteration ahead and held
until the compute of the micro-batch before has begun (its PRE_ATTN), so it
overlaps that compute and about two micro-batches' cache layers are on the GPU
at once (FlexGen's cache double buffer), and a KV_STORE on `gpu.d2h` right after
its attention (the only step that writes the cache). Weights: the dense part of
every layer is resident, and `policy.weights_gpu_share` of each layer's experts
(the lowest-numbered ones: FlexGen's static per-layer split, not routing-aware)
stays resident too. The rest of layer j + 1's experts, every one whether routed
or not, since FlexGen knows nothing of routing, are copied in while layer j
computes, into a double buffer of two layers (FlexGen's `weight_read_buf`), and
evicted after layer j + 1's last micro-batch. Every routed expert's FFN runs on
the GPU.

FlexGen issues weight and cache loads on two CUDA streams that share one PCIe
link (one copy engine); flowmoe has one `gpu.h2d` lane, so where both are issued
the cache load goes first (it is small, and the next micro-batch waits for it)
and the weights after it. The prologue is the first micro-batch's cache load;
layer 0's weights follow the second cache load. FlexGen's wrap-around prefetch
of the next step's layer 0 has no counterpart, since a plan covers one step. On
one lane, a cache load issued at k >= 1 queues behind the next layer's weights
issued at k = 0: when those copies outlast the compute of micro-batch k - 1 (an
I/O-bound step), micro-batch k computes during the weight copy and its
successor's cache load follows the weights instead of overlapping it (FlexGen's
per-iteration synchronisation would instead hold micro-batch k back). In a
prefill step KV_LOAD brings an empty cache layer: the GPU working copy that
attention writes into.
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.plan import Lane, Op
from flowmoe.core.scheduling import MicroBatchShape, PlanStream, Residency, SchedulerContext, StepShape
from flowmoe.schedulers._layer_nodes import (
    copied_experts,
    copy_experts,
    embeddings,
    evict_experts,
    layer_tail,
    lm_heads,
    two_layers_bytes,
)


class FlexGenScheduler:
    name: ClassVar[str] = "flexgen"
    summary: ClassVar[str] = (
        "FlexGen zig-zag block schedule: KV cache on the CPU loaded a micro-batch ahead, "
        "next layer's experts copied while this layer computes"
    )

    def __init__(self, context: SchedulerContext) -> None:
        self.context = context
        spec = context.spec
        self.resident_per_layer = int(context.policy.weights_gpu_share * spec.moe.experts + 1e-9)

    def offloaded(self, layer: int) -> range:
        """The experts of `layer` that live on the CPU and are copied in for every block."""
        spec = self.context.spec
        if not spec.is_moe_layer(layer):
            return range(0)
        return range(self.resident_per_layer, spec.moe.experts)

    def residency(self) -> Residency:
        spec = self.context.spec
        experts = {
            (layer, e)
            for layer in range(spec.layers)
            if spec.is_moe_layer(layer)
            for e in range(self.resident_per_layer)
        }
        return Residency(frozenset(range(spec.layers)), frozenset(experts))

    def weight_buffer_bytes(self) -> int:
        """Two consecutive layers of offloaded experts: the layer computing and the next."""
        spec = self.context.spec
        return two_layers_bytes(
            [len(self.offloaded(layer)) * spec.expert_bytes for layer in range(spec.layers)]
        )

    def kv_on_gpu(self) -> bool:
        return False

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        mbs, layers = step.micro_batches, spec.layers
        if not mbs:
            return
        nodes, last = embeddings(f, step)
        yield from nodes
        kv: dict[tuple[int, int], int] = {}  # (layer, mb) -> KV_LOAD id
        copies: dict[int, dict[int, int]] = {}  # layer -> expert -> PAGE_COPY id
        combines: dict[int, list[int]] = {}  # layer -> COMBINE ids
        # prologue: the first micro-batch's cache (layer 0's weights follow the next cache load)
        first = f.node(Op.KV_LOAD, Lane.GPU_H2D, 0, mbs[0])
        yield first
        kv[(0, mbs[0].index)] = first.id
        for layer in range(layers):
            combines[layer] = []
            for k, mb in enumerate(mbs):
                pre = f.node(Op.PRE_ATTN, Lane.GPU_COMPUTE, layer, mb, deps=[last[mb.index]])
                yield pre
                nxt = (layer, mbs[k + 1]) if k + 1 < len(mbs) else (layer + 1, mbs[0])
                if nxt[0] < layers:  # load_cache(j, k + 1), once compute(j, k) has begun
                    load = f.node(Op.KV_LOAD, Lane.GPU_H2D, nxt[0], nxt[1], deps=[pre.id])
                    yield load
                    kv[(nxt[0], nxt[1].index)] = load.id
                if k == 0:  # load_weight(j + 1), behind the cache load on the one copy lane
                    if layer == 0:
                        copies[0] = yield from copy_experts(f, 0, self.offloaded(0))
                    else:
                        yield from evict_experts(f, layer - 1, copies.pop(layer - 1), combines[layer - 1])
                    if layer + 1 < layers:
                        copies[layer + 1] = yield from copy_experts(f, layer + 1, self.offloaded(layer + 1))
                combine = yield from self._compute(
                    layer, mb, pre.id, kv.pop((layer, mb.index)), copies[layer]
                )
                combines[layer].append(combine)
                last[mb.index] = combine
        yield from evict_experts(f, layers - 1, copies.pop(layers - 1), combines[layers - 1])
        yield from lm_heads(f, step, last)

    def _compute(
        self, layer: int, mb: MicroBatchShape, pre: int, kv_load: int, copies: dict[int, int]
    ) -> PlanStream:
        """compute(j, k) after its PRE_ATTN, with store_cache(j, k) after the attention.
        Returns the COMBINE id."""
        f, spec = self.context.factory, self.context.spec
        gpu = Lane.GPU_COMPUTE
        attn = f.node(Op.GPU_ATTN, gpu, layer, mb, deps=[pre, kv_load])
        store = f.node(Op.KV_STORE, Lane.GPU_D2H, layer, mb, deps=[attn.id])
        post = f.node(Op.POST_ATTN, gpu, layer, mb, deps=[attn.id])
        yield attn
        yield store
        yield post
        outputs = (
            (yield from copied_experts(f, layer, mb, post.id, copies)) if spec.is_moe_layer(layer) else []
        )
        tail = layer_tail(f, spec, layer, mb, post.id, outputs)
        yield from tail
        return tail[-1].id
