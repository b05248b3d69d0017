"""`lru-cache`: the CPU-GPU collaborative expert cache (collaborative-inference paper, §III, Fig. 4).

The cache (§III-A): `expert_cache_slots` S experts on the GPU as an N-index,
M-way set-associative cache *by layer*, M = `cache_ways`, N = ⌊S / M⌋. MoE
layers 0..N-1 (counted over the MoE layers) each own one index, that is M slots
for their experts; MoE layers N and beyond have no slots and compute every
expert on the CPU, and never copy one. Without `expert_cache_slots`, S is
`weights_gpu_share` of all experts (the paper's S = ⌊free GPU memory / expert
size⌋ is what the planner's share stands for). Attention, routers, shared
experts and the KV cache stay on the GPU (§III: "reside continuously").

Per layer and micro-batch (Fig. 4 (a)): ① cache check of each routed expert
(ascending id); ②(a) a hit runs on the GPU; ②(b) a miss runs on the CPU next to
its weights (HIDDEN_OFFLOAD, EXPERT_FFN on cpu.compute, EXPERT_LOAD); ③ the
missed expert is fetched into its layer's set in the background for later
tokens ("post-fetching"): the least recently used way is evicted (EVICT after
its last GPU use) and the expert copied in. LRU order is per set (layer), the
cache starts empty and lives across steps. An expert whose fetch has not been
issued completely yet holds its way but is not usable: a lookup of it counts
as a miss and runs on the CPU (no second fetch).

One h2d link, two kinds of traffic: the few-KiB expert outputs a CPU expert
sends back (EXPERT_LOAD, on the critical path) and whole-expert fetches (off
it). A lane runs in emission order, so a fetch issued as one node would hold
up every output returned after it. Fetches are therefore copied in pages of
`page_bytes` and issued paced: after a micro-batch's EXPERT_LOAD, only as many
pending pages as the cost model says fit before the next one (that micro-batch's
CPU expert time and about one slot's attention; at least one page, so fetches
always progress), the rest wait for the next EXPERT_LOAD; what is left at the
end of a step is issued then, and the step ends when its fetches have: the
paper's low-way configurations are capped by the transfers ("(29, 2) caps
performance at around 2.2 tokens/second to indicate that data transfer rather
than computation is limiting", §IV-C), so its copies finish within the
token. An output thus waits for at most the pages issued in the slack before
it, not for whole experts: the paper keeps its transfers from waiting on each
other with two CUDA streams on the GPU's two copy engines (§III-C); flowmoe's
pacing does it on its one h2d lane.

GPU misses (`gpu_misses` 1; Mixtral-offloading, Eliseev & Mazur 2023, §3.1 and
github.com/dvmazur/mixtral-offloading: an LRU cache of k experts per layer, a miss loaded into it
and computed on the GPU, nothing prefetched): a miss is fetched into its set right away, all its
pages, and its FFN runs on the GPU after them; MoE layers without a set copy each routed expert
into one transient buffer, compute it and free it. No expert runs on the CPU.

Deviations: the cache covers the first N *MoE* layers (the paper's models have
no dense layers); lookups in a micro-batched step go micro-batch by micro-batch
(the paper runs batch 1). `--attention-on cpu` and `--ffn-on cpu` are refused:
the paper keeps attention on the GPU and places each expert by its cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from attrs import define, field, frozen

from flowmoe.core.options import option
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest
from flowmoe.core.ranges import IntRange
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
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    cpu_experts,
    embeddings,
    gpu_attention,
    latency_model,
    layer_tail,
    lm_heads,
    moe_layers,
    routing_of,
)
from flowmoe.schedulers.shared_options import ExpertCacheOptions, PagedOptions


@frozen
class LRUCacheOptions(ExpertCacheOptions, PagedOptions):
    """The cache's slots S and ways M (N = S / M indexes), and the page size of its loads."""

    cache_ways: int = option(
        4, "ways per set of the expert cache (its associativity M)", IntRange(1), label="ways"
    )
    gpu_misses: int = option(
        0, "1: a miss is fetched to the GPU at once and computed there (Mixtral-offloading's LRU); "
        "0: computed on the CPU and post-fetched (the collaborative-inference paper)", IntRange(0, 1),
        label="gpu-miss",
    )  # fmt: skip


@define
class _Line:
    """A way of a set: its expert, the pages still to issue, the last page issued (None once done
    in an earlier step: each step's plan runs on its own) and its last GPU use in this step."""

    expert: int
    room: int | None  # the EVICT of the way it replaced: its first page waits for it
    pending: list[int] = field(factory=list)  # pages not issued yet
    copy: int | None = None
    last_use: int | None = None

    @property
    def usable(self) -> bool:
        return not self.pending


class LRUCacheScheduler(Scheduler):
    name: ClassVar[str] = "lru-cache"
    summary: ClassVar[str] = (
        "collaborative inference: N-index x M-way LRU expert cache by layer; misses on the CPU, "
        "post-fetched behind; layers >= N on the CPU (--gpu-misses 1: misses fetched to the GPU)"
    )
    Options: ClassVar[type[LRUCacheOptions]] = LRUCacheOptions

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        spec, policy = context.spec, context.policy
        options = self.options = policy.options_for(self.Options)
        check_placement(self.name, policy)
        self.moe = moe_layers(spec)
        self.ways = min(options.cache_ways, spec.moe.experts)
        total = len(self.moe) * spec.moe.experts
        slots = options.expert_cache_slots or round(policy.weights_gpu_share * total)
        self.covered = self.moe[: slots // options.cache_ways]  # the N indexes: MoE layers 0..N-1
        self.sets: dict[int, OrderedDict[int, _Line]] = {layer: OrderedDict() for layer in self.covered}
        self.parts = max(1, -(-spec.expert_bytes // options.page_bytes))
        self._pending: list[tuple[_Line, int]] = []
        self._evicted: dict[
            tuple[int, int], int
        ] = {}  # (layer, expert) -> its EVICT in this step  # (line, layer) with pages to issue, oldest first
        self._cost = latency_model(context, self.name)
        probe = NodeFactory(spec)
        self._page_seconds = self._cost(
            probe.node(
                Op.PAGE_COPY, Lane.GPU_H2D, self.moe[0] if self.moe else 0, expert=0, part=0, parts=self.parts
            )
        )
        self.hits = 0
        self.misses = 0
        self._transient: int | None = None  # the last EVICT of the transient buffer (GPU misses)

    def residency(self) -> Residency:
        return Residency.dense_only(self.context.spec)

    def weight_buffer_bytes(self) -> int:
        transient = self.options.gpu_misses and len(self.covered) < len(self.moe)
        return (len(self.covered) * self.ways + transient) * self.context.spec.expert_bytes

    def report(self) -> dict[str, float]:
        lookups = self.hits + self.misses
        return {"hits": float(self.hits), "misses": float(self.misses),
                "hit_rate": self.hits / lookups if lookups else 0.0,
                "expert_cache_slots": float(len(self.covered) * self.ways)}  # fmt: skip

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        for line in (line for ways in self.sets.values() for line in ways.values()):
            line.room = line.copy = line.last_use = None
        self._evicted.clear()
        self._transient = None
        nodes, last = embeddings(f, step)
        yield from nodes
        for layer in range(spec.layers):
            for mb in step.micro_batches:
                attention = gpu_attention(f, layer, mb, last[mb.index])
                yield from attention
                post, outputs = attention[-1].id, []
                if spec.is_moe_layer(layer):
                    gate = f.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb, deps=[post])
                    yield gate
                    counts = yield from routing_of(RoutingRequest(layer, mb.index, gate.id))
                    attend = sum(self._cost(n) for n in [*attention, gate])  # the next slot's, about
                    outputs = yield from self._experts(layer, mb, gate.id, counts, attend)
                tail = layer_tail(f, spec, layer, mb, post, outputs)
                yield from tail
                last[mb.index] = tail[-1].id
        yield from lm_heads(f, step, last)
        yield from self._issue(float("inf"))  # the token's fetches end with it (see above)

    def _experts(
        self, layer: int, mb: MicroBatchShape, gate: int, counts: ExpertCounts, attend: float
    ) -> SubPlan[list[int]]:
        """Hits on the GPU, misses on the CPU (and fetched), then the pages that fit before the next
        output: the CPU experts' time and the next slot's attention (`attend`). -> outputs' last nodes."""
        f, outputs, missed = self.context.factory, [], []
        ways = self.sets.get(layer)
        for e, tokens in counts.counts:
            line = ways.get(e) if ways is not None else None
            if ways is not None and line is not None and line.usable:
                self.hits += 1
                ways.move_to_end(e)
                ffn = f.node(
                    Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, e, deps=[gate, line.copy], tokens=tokens
                )
                line.last_use = ffn.id
                outputs.append(ffn.id)
                yield ffn
                continue
            self.misses += 1
            if self.options.gpu_misses:
                outputs.append((yield from self._on_gpu(layer, mb, gate, ways, e, tokens)))
                continue
            missed.append((e, tokens))
            if ways is not None and line is None:
                yield from self._fetch(layer, ways, e)
            elif ways is not None and line is not None:
                ways.move_to_end(e)
        on_cpu = cpu_experts(f, layer, mb, gate, missed)
        yield from on_cpu
        if on_cpu:  # behind this output
            yield from self._issue(attend + sum(self._cost(n) for n in on_cpu if n.lane is Lane.CPU_COMPUTE))
        return [*outputs, on_cpu[-1].id] if on_cpu else outputs

    def _on_gpu(
        self, layer: int, mb: MicroBatchShape, gate: int, ways: OrderedDict[int, _Line] | None, expert: int,
        tokens: int,
    ) -> SubPlan[int]:  # fmt: skip
        """A GPU miss: the expert fetched into its set (or the transient buffer) at once, then its
        FFN on the GPU. -> the FFN's id."""
        f = self.context.factory
        if ways is not None:
            yield from self._fetch(layer, ways, expert)
            yield from self._issue(float("inf"))  # only this miss's pages are pending
            line = ways[expert]
            ffn = f.node(
                Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, expert, deps=[gate, line.copy], tokens=tokens
            )
            line.last_use = ffn.id
            yield ffn
            return ffn.id
        copy = f.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, mb, expert, deps=[gate, self._transient])
        ffn = f.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, expert, deps=[gate, copy.id], tokens=tokens)
        evict = f.node(Op.EVICT, Lane.GPU_COMPUTE, layer, mb, expert, deps=[ffn.id])
        self._transient = evict.id
        yield copy
        yield ffn
        yield evict
        return ffn.id

    def _fetch(self, layer: int, ways: OrderedDict[int, _Line], expert: int) -> PlanStream:
        """Evict the set's least recently used way if it is full; queue `expert`'s pages as most recent."""
        room = None
        if len(ways) >= self.ways:
            _, victim = ways.popitem(last=False)
            self._pending = [(line, at) for line, at in self._pending if line is not victim]
            if len(victim.pending) < self.parts:  # some of it was copied in
                deps = [victim.room, victim.copy, victim.last_use]
                evict = self.context.factory.node(
                    Op.EVICT, Lane.GPU_COMPUTE, layer, expert=victim.expert, deps=deps
                )
                room = evict.id
                self._evicted[(layer, victim.expert)] = evict.id
                yield evict
            else:  # nothing of it arrived: its way is still waiting for the eviction it was to follow
                room = victim.room
        line = _Line(expert, room, list(range(self.parts)))
        line.copy = self._evicted.get((layer, expert))  # its own earlier eviction, if this step had one
        ways[expert] = line
        self._pending.append((line, layer))

    def _issue(self, seconds: float) -> PlanStream:
        """Pending pages, oldest first, while they fit in `seconds` of link time (at least one)."""
        f, spent = self.context.factory, 0.0
        while self._pending and (spent == 0.0 or spent + self._page_seconds <= seconds):
            line, layer = self._pending[0]
            part = line.pending.pop(0)
            deps = [line.room, line.copy]
            page = f.node(
                Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=line.expert, deps=deps, part=part, parts=self.parts
            )
            line.copy = page.id
            spent += self._page_seconds
            if not line.pending:
                self._pending.pop(0)
            yield page
