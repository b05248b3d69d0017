"""`cgopipe`: MoE-Lightning's CPU-GPU-I/O pipeline (Cao et al., ASPLOS '25, §4 and §4.1, Algorithm 1).

Decode with `--attention-on cpu` (§4.1, Algorithm 1, the placement the paper's
performance model picks in its memory-constrained settings): attention runs on
the CPU next to the KV cache. For each (layer i, micro-batch j) slot in order
the launcher issues

    LOADH(i, j)            the attention output of j back to the GPU (h2d)
    W_PINTOG(i + 1, j)     chunk j of the next layer's paged weights (h2d)
    POSTATTN(i, j)         O projection, gate and every routed expert FFN, the tail (GPU)
    PREATTN(i, j + 2)      norm + QKV of the micro-batch two ahead (GPU),
    OFFLOADQKV(i, j + 2)   its q, k, v to the CPU (d2h),
    CPUATTN(i, j + 2)      and its attention on the CPU

so on the h2d lane the hidden load of j goes ahead of the weight chunk issued
with it, and on the GPU the pre-attention of j + 2 follows the FFN of j, so the
CPU attention of j + 2 runs while the GPU computes j + 1. Slots run on across
layers (j + 2 past the last micro-batch is the next layer's first ones), which
is what the prologue (PREATTN..CPUATTN of the first two slots) starts.

Prefill (§4: "for the prefill stage, we perform all the computation on GPU and
offload KV cache to CPU"), and decode with `--attention-on gpu` (the HRM
policy's other placement, §4.2; the paper notes CPU attention is "consistently
better" where memory is short): the FlexGen zig-zag order on the GPU. Per
layer and micro-batch the cache layer is brought in (KV_LOAD, but for the
`kv_gpu_share` the GPU keeps; empty in a prefill), then that micro-batch's
chunk of the next layer's weights, so on h2d each cache load goes ahead of the
weights issued with it; attention runs on the GPU and this step's k, v go back
to the CPU (KV_STORE). With `kv_gpu_share` 1 the whole cache lives on the GPU
and nothing of it moves.

Weights (§4.1 "weights paging"): `weights_gpu_share` of each layer's experts
stay resident (the most popular by the profile, else the lowest ids); the rest
of a layer is transferred in n chunks, n = the number of micro-batches ("we
chunk the weights to be transferred into n pages where n equals the number of
micro-batches"), into a GPU weight buffer of two layers' offloaded experts (one
in use, one filling). A layer's experts are evicted after its last
micro-batch, and the first page of an expert waits for the eviction of the
matching expert two MoE layers back.

A page (`page_bytes`, the policy's knob): with pages of an expert or more, a
PAGE_COPY node copies as many whole experts of the chunk as fit (one node per
chunk once a page holds the chunk); with smaller pages each expert goes in
ceil(expert / page) pages, the chunks cutting experts at page bounds. Where
pages are staged (below) each is its own node, after its own W_STAGE; where
not, nothing is issued between an expert's pages of a chunk on h2d, so they go
as one node (the run core/page_runs.py would merge them into).

Staging (Algorithm 1's W_CTOPIN; Appendix A, Fig. 11): MoE-Lightning copies
each page from pageable memory into a pinned buffer on the CPU before the
pinned -> GPU transfer, issued after the CPU attention of the same slot. Where
the weights are not pinned (`weights_pinned` False in the context: a
simulation of the paper's system) that copy is a W_STAGE node on cpu.stage:
the artifact (caoshiyi/artifacts, fastmoe/backend/execution_engine.py) runs
it on its own `copy_executor` thread beside the `cpu_executor` thread that
attends, so it overlaps the CPU attention and shares the host's DRAM with it
(the simulator's `HostMemoryShare`). Its pinned buffer holds one layer's
offloaded pages in n slots, and the copy into slot j first waits for that
slot's previous transfer to the GPU (`prefetch_events[slot].synchronize()`),
so a W_STAGE waits for the last PAGE_COPY of its chunk issued before it:
one paged layer back (with one micro-batch the lookahead issues the copy a
slot earlier, so two layers back: a buffer of two). flowmoe's own runtime pins the experts' CPU
copies once at start-up, so real runs go pinned -> GPU directly.

Deviations: `--ffn-on cpu` is refused (every expert FFN runs on the GPU, as in
Algorithm 1). A partly shared cache (0 < `kv_gpu_share` < 1, GPU attention)
is split by sequence as FlexGen splits it (`kv_gpu_sequences`): each cache
layer keeps a micro-batch's first ⌊share x sequences⌋ sequences on the GPU, the
plan prices the copies of the others, and a real run allocates and copies just
so. Micro-batches come as the engine forms them
(MoE-Lightning's balanced request batching lives there).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from attrs import evolve

from flowmoe.core.plan import Lane, Op, RoutingRequest, TaskNode
from flowmoe.core.scheduling import (
    MicroBatchShape,
    PlanStream,
    Residency,
    Scheduler,
    SchedulerContext,
    StepShape,
)
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    embeddings,
    gpu_attention,
    kept_per_layer,
    kept_sequences,
    kv_transfer,
    layer_tail,
    lm_heads,
    moe_layers,
    offloaded_kv_attention,
    routing_of,
)
from flowmoe.schedulers.shared_options import PagedOptions

LOOKAHEAD = 2  # CPU attention runs this many micro-batches ahead of the GPU FFN
Slot = tuple[int, MicroBatchShape]  # (layer, micro-batch)
Page = tuple[tuple[int, ...], int]  # (experts, page index within the expert or -1 for whole experts)
Run = tuple[tuple[int, ...], int, int]  # (experts, first page index or -1, pages): one PAGE_COPY node


class CGOPipeScheduler(Scheduler):
    name: ClassVar[str] = "cgopipe"
    summary: ClassVar[str] = (
        "MoE-Lightning CGOPipe: with --attention-on cpu, attention on the CPU 2 micro-batches ahead, each "
        "hidden load then a chunk of the next layer's weights; prefill (and --attention-on gpu) on the GPU"
    )
    Options: ClassVar[type[PagedOptions]] = PagedOptions

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        spec, policy = context.spec, context.policy
        self.options = policy.options_for(self.Options)
        check_placement(self.name, policy, attention=("cpu", "gpu"))
        self.gpu_attention = policy.attention_on == "gpu"
        self.kv_share = policy.kv_gpu_share if self.gpu_attention else 0.0  # CPU attention: cache on the CPU
        split = kept_per_layer(spec, context.popularity, policy.weights_gpu_share)
        self.moe = moe_layers(spec)
        self.resident = {m: sorted(kept) for m, (kept, _) in split.items()}  # experts kept on the GPU
        self.paged = {m: sorted(rest) for m, (_, rest) in split.items()}  # paged in for every use
        self.parts = max(1, -(-spec.expert_bytes // self.options.page_bytes))  # pages per expert
        self.per_page = max(1, self.options.page_bytes // spec.expert_bytes)  # whole experts per page
        self.chunks: dict[tuple[int, int, int], tuple[Page, ...]] = {}  # (layer, chunk, chunks) -> its pages
        self.runs: dict[tuple[int, int, int], list[Run]] = {}  # (layer, chunk, chunks) -> its copies

    def residency(self) -> Residency:
        experts = frozenset((m, e) for m, kept in self.resident.items() for e in kept)
        return Residency(Residency.dense_only(self.context.spec).dense, experts)

    def weight_buffer_bytes(self) -> int:
        widest = max((len(p) for p in self.paged.values()), default=0)
        return 2 * widest * self.context.spec.expert_bytes

    def kv_on_gpu(self) -> bool:
        """GPU attention with all of the cache on the GPU; else the cache's home is the CPU."""
        return self.gpu_attention and self.kv_share == 1.0

    def kv_gpu_sequences(self, sequences: int) -> int:
        """Of a micro-batch's `sequences` cache slots, the whole sequences every cache layer keeps on
        the GPU (`kept_sequences`, FlexGen's rounding); none with CPU attention."""
        return kept_sequences(self.kv_share, sequences)

    def plan(self, step: StepShape) -> PlanStream:
        return _Plan(self, step).run()


class _Plan:
    """One step of CGOPipe: the state that threads through its slots."""

    def __init__(self, scheduler: CGOPipeScheduler, step: StepShape) -> None:
        self.scheduler, self.step = scheduler, step
        self.factory, self.spec = scheduler.context.factory, scheduler.context.spec
        self.last: dict[int, int] = {}  # micro-batch -> its last node so far
        self.attended: dict[tuple[int, int], int] = {}  # (layer, mb) -> CPU_ATTN
        self.arrived: dict[tuple[int, int], int] = {}  # (layer, expert) -> its last page
        self.evicted: dict[int, list[int]] = {}  # layer -> EVICT of each paged expert
        self.staged: dict[tuple[int, tuple[int, ...], int], int] = {}  # (layer, experts, part) -> W_STAGE
        self.sent: dict[int, int] = {}  # chunk (pinned slot) -> its last PAGE_COPY so far

    def run(self) -> PlanStream:
        nodes, self.last = embeddings(self.factory, self.step)
        yield from nodes
        if self._paged_at(0):
            yield from self._stage(0, 0, 1)
            yield from self._pages(0, 0, 1)
        gpu_pass = self.step.prefill or self.scheduler.gpu_attention
        yield from (self._gpu_attention_pass() if gpu_pass else self._decode())
        yield from lm_heads(self.factory, self.step, self.last)

    def _decode(self) -> PlanStream:
        """Algorithm 1: the prologue, then LOADH, W_PINTOG, POSTATTN, PREATTN..CPUATTN(j + 2) per slot."""
        mbs = self.step.micro_batches
        slots: list[Slot] = [(layer, mb) for layer in range(self.spec.layers) for mb in mbs]
        ahead = min(LOOKAHEAD, len(slots))
        for slot in slots[:ahead]:
            yield from self._cpu_attention(slot)
        for k, (layer, mb) in enumerate(slots):
            load = self.factory.node(
                Op.HIDDEN_LOAD, Lane.GPU_H2D, layer, mb, deps=[self.attended[(layer, mb.index)]]
            )
            yield load
            if self._paged_at(layer + 1):
                yield from self._pages(layer + 1, mb.index, len(mbs))
            post = self.factory.node(Op.POST_ATTN, Lane.GPU_COMPUTE, layer, mb, deps=[load.id])
            yield post
            yield from self._ffn(layer, mb, post.id)
            if mb is mbs[-1] and self._paged_at(layer):
                yield from self._evict(layer)
            if k + ahead < len(slots):
                yield from self._cpu_attention(slots[k + ahead])

    def _gpu_attention_pass(self) -> PlanStream:
        """Attention on the GPU, layer by layer (zig-zag): each micro-batch's cache layer in (but the
        GPU's share), attention, this step's k, v back; a chunk of the next layer's weights after
        each cache load, so on h2d the next micro-batch's cache goes ahead of the weights."""
        mbs, kv_gpu = self.step.micro_batches, self.scheduler.kv_on_gpu()
        for layer in range(self.spec.layers):
            for mb in mbs:
                kept = self.scheduler.kv_gpu_sequences(mb.sequences)  # of mb's cache sequences, on the GPU
                kv = None if kv_gpu else kv_transfer(self.factory, Op.KV_LOAD, layer, mb, (), kept)
                if kv is not None:
                    yield kv
                if self._paged_at(layer + 1):
                    yield from self._stage(layer + 1, mb.index, len(mbs))
                    yield from self._pages(layer + 1, mb.index, len(mbs))
                if kv is None:
                    attention = gpu_attention(self.factory, layer, mb, self.last[mb.index])
                else:
                    nodes = offloaded_kv_attention(self.factory, layer, mb, self.last[mb.index], kv.id)
                    store = kv_transfer(self.factory, Op.KV_STORE, layer, mb, nodes.store.deps, kept)
                    attention = list(evolve(nodes, store=store))
                yield from attention
                yield from self._ffn(layer, mb, attention[-1].id)
            if self._paged_at(layer):
                yield from self._evict(layer)

    def _paged_at(self, layer: int) -> bool:
        return layer in self.scheduler.paged and bool(self.scheduler.paged[layer])

    def _cpu_attention(self, slot: Slot) -> Iterator[TaskNode]:
        """PREATTN (gpu) -> OFFLOADQKV (d2h) -> CPUATTN, then W_CTOPIN of the slot's weight chunk."""
        layer, mb = slot
        pre = self.factory.node(Op.PRE_ATTN, Lane.GPU_COMPUTE, layer, mb, deps=[self.last[mb.index]])
        qkv = self.factory.node(Op.QKV_OFFLOAD, Lane.GPU_D2H, layer, mb, deps=[pre.id])
        attn = self.factory.node(Op.CPU_ATTN, Lane.CPU_COMPUTE, layer, mb, deps=[qkv.id])
        self.attended[(layer, mb.index)] = attn.id
        yield from (pre, qkv, attn)
        yield from self._stage(layer + 1, mb.index, len(self.step.micro_batches))  # W_CTOPIN(i + 1, j)

    def _chunk(self, layer: int, chunk: int, chunks: int) -> tuple[Page, ...]:
        """The pages of chunk `chunk` of `chunks` of `layer`'s offloaded experts, `page_bytes` each:
        whole experts per page where a page holds one or more, else each expert in `parts` pages.
        The same every step: worked out once per scheduler."""
        key = (layer, chunk, chunks)
        pages = self.scheduler.chunks.get(key)
        if pages is None:
            pages = self.scheduler.chunks[key] = self._chunk_pages(layer, chunk, chunks)
        return pages

    def _chunk_pages(self, layer: int, chunk: int, chunks: int) -> tuple[Page, ...]:
        paged, parts, per_page = self.scheduler.paged[layer], self.scheduler.parts, self.scheduler.per_page
        if per_page > 1:
            mine = paged[len(paged) * chunk // chunks : len(paged) * (chunk + 1) // chunks]
            return tuple((tuple(mine[i : i + per_page]), -1) for i in range(0, len(mine), per_page))
        pages: list[Page] = [((e,), p) for e in paged for p in range(parts)]
        return tuple(pages[len(pages) * chunk // chunks : len(pages) * (chunk + 1) // chunks])

    def _stage(self, layer: int, chunk: int, chunks: int) -> Iterator[TaskNode]:
        """W_CTOPIN: where the weights are not pinned, the chunk's pages copied into pinned buffers on
        the CPU first."""
        if self.scheduler.context.weights_pinned or not self._paged_at(layer):
            return
        slot = self.sent.get(chunk)  # the slot's previous pages must have left for the GPU
        for group, part in self._chunk(layer, chunk, chunks):
            parts = self.scheduler.parts if part >= 0 else 1
            node = self.factory.node(
                Op.W_STAGE, Lane.CPU_STAGE, layer, expert=group[0], deps=[slot], more=group[1:], part=part,
                parts=parts,
            )  # fmt: skip
            self.staged[(layer, group, part)] = node.id
            yield node

    def _pages(self, layer: int, chunk: int, chunks: int) -> Iterator[TaskNode]:
        """W_PINTOG: the chunk's pages to the GPU, each after its staging copy (if any) and, for an
        expert's first page, the eviction whose buffer it reuses. Where nothing is staged, an expert's
        consecutive pages of the chunk go as one node (nothing is issued between them on their lane,
        so this is the node core/page_runs.py would merge them into, built once instead of per page)."""
        position = self.scheduler.moe.index(layer)
        freed = self.evicted.get(self.scheduler.moe[position - 2], []) if position >= 2 else []
        room = dict(zip(self.scheduler.paged[layer], freed, strict=False))
        for group, part, pages in self._runs(layer, chunk, chunks):
            parts = self.scheduler.parts if part >= 0 else 1
            deps = [self.staged.pop((layer, group, part), None), *(room.get(e) for e in group if part <= 0)]
            node = self.factory.node(
                Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=group[0], deps=deps, more=group[1:],
                part=part, parts=parts, pages=pages,
            )  # fmt: skip
            if part + pages in (0, parts):
                self.arrived.update(dict.fromkeys(((layer, e) for e in group), node.id))
            self.sent[chunk] = node.id
            yield node

    def _runs(self, layer: int, chunk: int, chunks: int) -> list[Run]:
        """(experts, first part, pages) of the chunk's copies. The same every step: worked out once
        per scheduler."""
        key = (layer, chunk, chunks)
        runs = self.scheduler.runs.get(key)
        if runs is None:
            runs = self.scheduler.runs[key] = self._chunk_runs(layer, chunk, chunks)
        return runs

    def _chunk_runs(self, layer: int, chunk: int, chunks: int) -> list[Run]:
        """Each page alone where pages are staged (each waits for its own W_STAGE) or hold whole
        experts, else an expert's consecutive pages of the chunk together, worked out from the chunk's
        bounds (as `_chunk_pages` cuts them) without listing its pages: a tiny page costs no memory."""
        if not self.scheduler.context.weights_pinned or self.scheduler.per_page > 1:
            return [(group, part, 1) for group, part in self._chunk(layer, chunk, chunks)]
        paged, parts = self.scheduler.paged[layer], self.scheduler.parts
        total = len(paged) * parts  # the layer's pages, expert by expert
        lo, hi = total * chunk // chunks, total * (chunk + 1) // chunks  # the chunk's pages [lo, hi)
        runs: list[Run] = []
        for i in range(lo // parts, -(-hi // parts) if hi > lo else 0):
            first, end = max(lo, i * parts), min(hi, (i + 1) * parts)
            runs.append(((paged[i],), first - i * parts, end - first))
        return runs

    def _ffn(self, layer: int, mb: MicroBatchShape, post: int) -> PlanStream:
        """After POST_ATTN: the gate, every routed expert on the GPU, the tail."""
        f, gpu = self.factory, Lane.GPU_COMPUTE
        outputs: list[int] = []
        if self.spec.is_moe_layer(layer):
            gate = f.node(Op.GATE, gpu, layer, mb, deps=[post])
            yield gate
            counts = yield from routing_of(RoutingRequest(layer, mb.index, gate.id))
            for e, tokens in counts.counts:
                arrived = self.arrived.get((layer, e))
                ffn = f.node(Op.EXPERT_FFN, gpu, layer, mb, e, deps=[gate.id, arrived], tokens=tokens)
                yield ffn
                outputs.append(ffn.id)
        tail = layer_tail(f, self.spec, layer, mb, post, outputs)
        yield from tail
        self.last[mb.index] = tail[-1].id

    def _evict(self, layer: int) -> Iterator[TaskNode]:
        """After the layer's last FFN on the GPU lane (and its pages, for experts nobody used)."""
        evicts = [
            self.factory.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=e, deps=[self.arrived[(layer, e)]])
            for e in self.scheduler.paged[layer]
        ]
        self.evicted[layer] = [n.id for n in evicts]
        yield from evicts
