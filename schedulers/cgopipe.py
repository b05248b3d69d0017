"""`cgopipe`: MoE-Lightning's CPU-GPU-I/O pipeline (Cao et al., 2024, §4.1 "CGOPipe", Algorithm 1).

Attention runs on the CPU next to the KV cache: PRE_ATTN on the GPU, q/k/v
offloaded (d2h), CPU_ATTN, the attention output loaded back (h2d), then
POST_ATTN, the gate and every expert FFN on the GPU. The GPU issues the
pre-attention of micro-batch j+2 before the post-attention of micro-batch j, so
the CPU attention of j+2 runs while the GPU computes the FFN of j (the pipeline
runs on across layers: (layer, micro-batch) slots in order; with fewer than
three micro-batches the lead shrinks to n-1, since a micro-batch's next layer
cannot start before its combine).

Weights (§4.1 "paged weights"): `weights_gpu_share` of each layer's experts
stay resident (the most popular by the profile, else the lowest ids); the rest
of a layer is transferred in pages of at most `page_bytes` into a GPU weight
buffer of twice that offloaded share (one half in use, one half filling). The
pages of layer l+1 are issued in n chunks, one after each hidden-state load of
layer l, so on the h2d lane they interleave with the hidden-state transfers; a
layer's experts are evicted after its last micro-batch, and the first page of
an expert waits for the eviction of the matching expert two MoE layers back.
The paper's staging copy CPU -> pinned memory is not a node here: the CPU
copies of the weights are the staging area, and a page goes pinned -> GPU.

Micro-batches come as the engine forms them (MoE-Lightning's balanced request
batching lives there).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from flowmoe.core.plan import Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import MicroBatchShape, PlanStream, Residency, SchedulerContext, StepShape
from flowmoe.schedulers._layer_nodes import embeddings, kept_per_layer, layer_tail, lm_heads, moe_layers

LOOKAHEAD = 2  # CPU attention runs this many micro-batches ahead of the GPU FFN
Slot = tuple[int, MicroBatchShape]  # (layer, micro-batch)


class CGOPipeScheduler:
    name: ClassVar[str] = "cgopipe"
    summary: ClassVar[str] = (
        "MoE-Lightning CGOPipe: CPU attention 2 micro-batches ahead, next layer's weights paged between "
        "hidden-state loads"
    )

    def __init__(self, context: SchedulerContext) -> None:
        self.context = context
        spec, policy = context.spec, context.policy
        split = kept_per_layer(spec, context.popularity, policy.weights_gpu_share)
        self.moe = moe_layers(spec)
        self.resident = {m: sorted(kept) for m, (kept, _) in split.items()}  # experts kept on the GPU
        self.paged = {m: sorted(rest) for m, (_, rest) in split.items()}  # paged in for every use
        self.parts = max(1, -(-spec.expert_bytes // policy.page_bytes))

    def residency(self) -> Residency:
        experts = frozenset((m, e) for m, kept in self.resident.items() for e in kept)
        return Residency(Residency.dense_only(self.context.spec).dense, experts)

    def weight_buffer_bytes(self) -> int:
        widest = max((len(p) for p in self.paged.values()), default=0)
        return 2 * widest * self.context.spec.expert_bytes

    def kv_on_gpu(self) -> bool:
        return False

    def plan(self, step: StepShape) -> PlanStream:
        return _Plan(self, step).run()


class _Plan:
    """One step of CGOPipe: the state that threads through its slots."""

    def __init__(self, scheduler: CGOPipeScheduler, step: StepShape) -> None:
        self.s, self.step = scheduler, step
        self.f, self.spec = scheduler.context.factory, scheduler.context.spec
        self.last: dict[int, int] = {}  # micro-batch -> its last node so far
        self.hidden: dict[tuple[int, int], int] = {}  # (layer, mb) -> HIDDEN_LOAD
        self.arrived: dict[tuple[int, int], int] = {}  # (layer, expert) -> its last page
        self.evicted: dict[int, list[int]] = {}  # layer -> EVICT of each paged expert

    def run(self) -> PlanStream:
        mbs = self.step.micro_batches
        slots: list[Slot] = [(layer, mb) for layer in range(self.spec.layers) for mb in mbs]
        ahead = min(LOOKAHEAD, len(mbs) - 1)
        nodes, self.last = embeddings(self.f, self.step)
        yield from nodes
        if self._paged_at(0):
            yield from self._pages(0, 0, 1)
        for slot in slots[:ahead]:
            yield from self._attention(slot)
        for k, (layer, mb) in enumerate(slots):
            if k + ahead < len(slots):
                yield from self._attention(slots[k + ahead])
            if self._paged_at(layer + 1):
                yield from self._pages(layer + 1, mb.index, len(mbs))
            yield from self._ffn(layer, mb)
            if mb is mbs[-1] and self._paged_at(layer):
                yield from self._evict(layer)
        yield from lm_heads(self.f, self.step, self.last)

    def _paged_at(self, layer: int) -> bool:
        return layer in self.s.paged and bool(self.s.paged[layer])

    def _attention(self, slot: Slot) -> Iterator[TaskNode]:
        """PRE_ATTN (gpu) -> QKV_OFFLOAD (d2h) -> CPU_ATTN -> HIDDEN_LOAD (h2d)."""
        layer, mb = slot
        pre = self.f.node(Op.PRE_ATTN, Lane.GPU_COMPUTE, layer, mb, deps=[self.last[mb.index]])
        qkv = self.f.node(Op.QKV_OFFLOAD, Lane.GPU_D2H, layer, mb, deps=[pre.id])
        attn = self.f.node(Op.CPU_ATTN, Lane.CPU_COMPUTE, layer, mb, deps=[qkv.id])
        load = self.f.node(Op.HIDDEN_LOAD, Lane.GPU_H2D, layer, mb, deps=[attn.id])
        self.hidden[(layer, mb.index)] = load.id
        yield from (pre, qkv, attn, load)

    def _pages(self, layer: int, chunk: int, chunks: int) -> Iterator[TaskNode]:
        """Chunk `chunk` of `chunks` of the pages of `layer`'s offloaded experts."""
        paged, parts = self.s.paged[layer], self.s.parts
        pages = [(i, e, p) for i, e in enumerate(paged) for p in range(parts)]
        position = self.s.moe.index(layer)
        freed = self.evicted.get(self.s.moe[position - 2], []) if position >= 2 else []
        for i, e, p in pages[len(pages) * chunk // chunks : len(pages) * (chunk + 1) // chunks]:
            room = freed[i] if p == 0 and i < len(freed) else None
            node = self.f.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=e, deps=[room], part=p, parts=parts)
            if p == parts - 1:
                self.arrived[(layer, e)] = node.id
            yield node

    def _ffn(self, layer: int, mb: MicroBatchShape) -> PlanStream:
        """POST_ATTN after the hidden-state load, the gate, every routed expert on the GPU, the tail."""
        f, gpu = self.f, Lane.GPU_COMPUTE
        post = f.node(Op.POST_ATTN, gpu, layer, mb, deps=[self.hidden[(layer, mb.index)]])
        yield post
        outputs: list[int] = []
        if self.spec.is_moe_layer(layer):
            gate = f.node(Op.GATE, gpu, layer, mb, deps=[post.id])
            yield gate
            counts = yield RoutingRequest(layer, mb.index, gate.id)
            for e, tokens in counts.counts:
                arrived = self.arrived.get((layer, e))
                ffn = f.node(Op.EXPERT_FFN, gpu, layer, mb, e, deps=[gate.id, arrived], tokens=tokens)
                yield ffn
                outputs.append(ffn.id)
        tail = layer_tail(f, self.spec, layer, mb, post.id, outputs)
        yield from tail
        self.last[mb.index] = tail[-1].id

    def _evict(self, layer: int) -> Iterator[TaskNode]:
        """After the layer's last FFN on the GPU lane (and its pages, for experts nobody used)."""
        evicts = [
            self.f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=e, deps=[self.arrived[(layer, e)]])
            for e in self.s.paged[layer]
        ]
        self.evicted[layer] = [n.id for n in evicts]
        yield from evicts
