"""`klotski`: Klotski's expert-aware multi-batch pipeline (Fang et al., 2025, §5 Algorithm 1, §6, §7).

A group of n micro-batches goes through each layer together, so one copy of a
layer's weights serves all n (§5). Per layer l, as Algorithm 1 orders it:

- attention layer, batch by batch: the KV cache of batch k + 1 is loaded
  (KV_LOAD, h2d) while batch k computes (line 14), attention runs on the GPU
  and this step's k, v go back to the CPU (KV_STORE, d2h, line 17). The K hot
  experts of an MoE layer are prefetched here, during the attention (§5, §6.2),
  issued right after the second-to-last batch's cache load;
- gate layer, batch by batch: after each batch's gate the cold experts it needs
  and nobody fetched yet are copied, in arrival order ("real-time transfer",
  line 3);
- expert layer: first the next layer's attention weights and its first
  batch's cache are issued (lines 4, 6); the GPU computes the hot experts
  first for every batch of the group, then the cold ones in arrival order,
  and evicts each expert after its last batch (a hot expert nobody routed to
  is evicted after the gates).

Barriers (Algorithm 1 line 18, and the host's reads of the routing): each
layer ends in sync(load_weight_stream), and the host issues a layer's loads
only when it gets there. So no gate starts before the layer's hot experts are
in, and what the attention layer issues (the hot experts, the caches of batches
1..n-1) waits for the layer before to end; the next layer's attention weights
go out once the last gate's routing is read. The link idles while the GPU ends
a layer, which is what computing the hot experts first shortens (§5). With
every expert prefetched (`hot_experts` = E) this is the ablation's "+ Multi
batches" (§3.2, Fig. 4(b): the whole MoE layer loads during the attention, the
gates wait for all of it), with n = 1 its "simple pipeline" (§9.5).

Weights and cache (§6.1): the caches of the first `kv_gpu_share` of the
layers stay on the GPU, as Klotski's code places them layer by layer
(mindspore-lab/models research/SYSU/Klotski/mixtral/configuration_mixtral.py,
`memory_cost_mixtral`: the first m layers' caches on the GPU, the rest on the
CPU); their copies move no bytes, and both the memory check and a real run
hold them on the GPU (`kv_gpu_layers`: the run attends them there, their
KV_LOAD and KV_STORE do nothing). The rest
lives on the CPU, in pageable memory (KV copies `pageable`): Klotski's cache
is FlexGen's, allocated unpinned (the same code, pytorch_backend.py,
`init_cache_one_gpu_batch`: "disable pin_memory due to high memory
overhead"). Its CPU weights are pinned "when sufficient CPU memory is
available" (§6.1), else their copies are pageable
(the context's `weights_pinned`). Each layer's dense part (attention, router,
shared experts: flowmoe copies them as one) is copied in during the previous
layer's experts and evicted after the layer's last batch, into a buffer of two
layers; `weights_gpu_share` of the experts (the most popular) stay resident.

Disk tier (§6.1), where host memory cannot hold the offloaded weights: the last
layers are homed on disk and each is read into host memory a layer ahead
(DISK_LOAD on disk.read) into a buffer of two such layers, on every pass.
Klotski's code reads its disk tensors through the OS page cache (FlexGen's
TorchDisk: `np.lib.format.open_memmap`), and Linux keeps nothing of a cyclic
scan larger than the cache: a refaulting page is activated only if its refault
distance fits the active list, "we don't act on pages that couldn't stay
resident even if all the memory was available to the page cache"
(mm/workingset.c, workingset_refault), so each disk-homed byte is evicted before
its next use and read from disk every step.

Prefetcher (§6.2): the hot experts of MoE layer l are the K (`hot_experts`,
default top-k) most counted by a correlation table from the previous MoE
layer's routing of the same batches (path length 1): each previous expert's
tokens count for its top-k followers, as Klotski's code aggregates them. The
table is seeded from the routing profile (`popularity`) and updated from every
routing seen (the first steps are the warm-up); the first MoE layer's are the
most popular so far.

Planner (§7): the smallest n in 1..(micro-batches) meeting Eqs. (5)-(7) with
the cost model's times, one batch's attention t_A and gate t_G, one expert's
copy t_E (for the tokens of n batches: t_cE), a layer's dense copy t_dense:

    (5)  n(t_A + t_G)                       >= K t_E
    (6)  n(t_A + t_G) + K t_cE              >= (K + 1) t_E
    (7)  n(t_A + t_G) + (K + |Q|) t_cE      >= (K + |Q|) t_E + t_dense

with |Q| the expected number of cold experts a layer activates (uniform
routing of n batches' tokens; the paper takes it from statistics); if no n
satisfies them, all micro-batches form one group. `group_size` overrides it.

Deviations: the gate's weights travel with the attention weights (one dense
copy), so Eq. (4) holds by construction and t_io_G is 0 in (5)-(7); the
correlation table learns from per-token paths where the routing source gives
them (synthetic routing), else from per-(layer, micro-batch) expert counts
with tokens assumed independent within a micro-batch (a real run's gates and
recorded traces hand the scheduler counts only); the hidden states stay on
the GPU between layers (the paper moves them too; they are small next to the
cache); the paper loads caches and weights on separate streams that share the
link, flowmoe's one h2d lane runs them in that order instead (so the hot
experts go behind the attention layer's cache loads, not beside them); a disk
layer is read whole (Klotski's code reads each tensor when it is copied).
`--attention-on cpu` and `--ffn-on cpu` are refused: Klotski computes
everything on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

from attrs import define, evolve, field, frozen

from flowmoe.core.options import option
from flowmoe.core.plan import ExpertCounts, Lane, Op, RoutingRequest, TaskNode
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
from flowmoe.schedulers._correlation import CorrelationTable
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    embeddings,
    kept_per_layer,
    latency_model,
    layer_tail,
    lm_heads,
    moe_layers,
    offloaded_kv_attention,
    routing_of,
    two_layers_bytes,
)
from flowmoe.schedulers.shared_options import HotExpertsOptions

Group = tuple[MicroBatchShape, ...]


@frozen
class KlotskiOptions(HotExpertsOptions):
    """Klotski's group size n (its K hot experts are `hot_experts`, shared with hybrimoe)."""

    group_size: int = option(
        0, "micro-batches per group, Klotski's n (0: its constraint planner chooses)", IntRange(0), label="n"
    )


class KlotskiScheduler(Scheduler):
    name: ClassVar[str] = "klotski"
    summary: ClassVar[str] = (
        "Klotski: n micro-batches per layer; attention weights and KV cache loaded per layer and batch, "
        "hot experts prefetched by correlation during attention and computed first"
    )
    Options: ClassVar[type[KlotskiOptions]] = KlotskiOptions

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        spec, policy = context.spec, context.policy
        self.options = policy.options_for(self.Options)
        check_placement(self.name, policy)
        split = kept_per_layer(spec, context.popularity, policy.weights_gpu_share)
        self.moe = moe_layers(spec)
        self.resident = {m: set(kept) for m, (kept, _) in split.items()}
        offloaded = spec.moe.experts - round(policy.weights_gpu_share * spec.moe.experts)
        self.k = min(self.options.hot_experts or spec.moe.top_k, offloaded)
        self.offloaded = offloaded
        self.kv_kept = round(policy.kv_gpu_share * spec.layers)  # layers whose cache stays on the GPU
        self.table = CorrelationTable.seeded(self.moe, spec.moe.experts, context.popularity, spec.moe.top_k)
        self._cost = latency_model(context, self.name)
        self.on_disk = self._disk_layers(context.host_weight_bytes)

    def _disk_layers(self, host: int | None) -> frozenset[int]:
        """§6.1's disk tier: the last layers, as few as leave the rest of the offloaded weights and a
        buffer of two disk layers within `host` bytes of host memory. None when it all fits, and none
        when not even that fits (the host-memory check then refuses the run)."""
        spec = self.context.spec
        experts = self.offloaded * spec.expert_bytes
        sizes = [
            spec.layer_dense_bytes(layer) + (experts if layer in self.moe else 0)
            for layer in range(spec.layers)
        ]
        if host is None or sum(sizes) <= host:
            return frozenset()
        for first in range(spec.layers - 1, -1, -1):  # layers first.. on disk
            if sum(sizes[:first]) + 2 * max(sizes[first:]) <= host:
                return frozenset(range(first, spec.layers))
        return frozenset()

    def disk_tier(self) -> bool:
        """Whether weights the host memory cannot hold are read from disk (DISK_LOAD on disk.read)."""
        return bool(self.on_disk)

    def residency(self) -> Residency:
        experts = frozenset((m, e) for m, kept in self.resident.items() for e in kept)
        return Residency(frozenset(), experts)

    def weight_buffer_bytes(self) -> int:
        """Two layers' dense parts; one layer's offloaded experts: the next layer's hot experts load
        only once this layer has ended and evicted its own (the barriers), as Klotski's code reserves
        GPU memory for one layer's experts (`memory_cost_mixtral`: `expert * 8`)."""
        spec = self.context.spec
        dense = two_layers_bytes([spec.layer_dense_bytes(layer) for layer in range(spec.layers)])
        return dense + (self.offloaded * spec.expert_bytes if self.moe else 0)

    def kv_on_gpu(self) -> bool:
        return False

    def kv_gpu_layers(self) -> frozenset[int]:
        """The layers whose cache the GPU keeps: the first `kv_gpu_share` of them (§6.1)."""
        return frozenset(range(self.kv_kept))

    def group_size(self, step: StepShape) -> int:
        """Policy's n, else the smallest n meeting Eqs. (5)-(7) (all micro-batches if none does)."""
        count = len(step.micro_batches)
        if self.options.group_size:
            return min(self.options.group_size, count)
        spec, mb, cost = self.context.spec, step.micro_batches[0], self._cost
        made = self.context.factory  # priced as the run's copies are: in its expert and attention formats
        probe = NodeFactory(spec, expert_format=made.expert_format, attention_format=made.attention_format)
        layer = self.moe[0] if self.moe else 0
        attention = offloaded_kv_attention(probe, layer, mb, 0, 0)
        t_attend = sum(cost(n) for n in attention if n.lane is Lane.GPU_COMPUTE)
        t_attend += cost(probe.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb))
        t_copy = cost(probe.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=0))
        t_dense = cost(probe.node(Op.PAGE_COPY, Lane.GPU_H2D, layer))
        m = spec.moe
        for n in range(1, count + 1):
            tokens = n * mb.tokens
            per_expert = max(1, -(-tokens * m.top_k // m.experts))
            t_ffn = cost(probe.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, 0, tokens=per_expert))
            cold = (self.offloaded - self.k) * (1 - (1 - m.top_k / m.experts) ** tokens)
            ahead = n * t_attend
            if (
                ahead >= self.k * t_copy
                and ahead + self.k * t_ffn >= (self.k + 1) * t_copy
                and ahead + (self.k + cold) * t_ffn >= (self.k + cold) * t_copy + t_dense
            ):
                return n
        return count

    def plan(self, step: StepShape) -> PlanStream:
        n = self.group_size(step)
        nodes, last = embeddings(self.context.factory, step)
        yield from nodes
        mbs, evicted = step.micro_batches, _Evicted()
        for start in range(0, len(mbs), n):
            yield from _Group(self, mbs[start : start + n], last, evicted).run()
        yield from lm_heads(self.context.factory, step, last)


@define
class _Evicted:
    """A step's evictions, shared by its groups: every dense EVICT in order (the dense buffer), those
    of disk-homed layers and the disk reads so far (the host buffer of disk layers)."""

    dense: list[int] = field(factory=list)
    disk: list[int] = field(factory=list)
    reads: int = 0


class _Group:
    """One group of micro-batches through every layer."""

    def __init__(
        self, scheduler: KlotskiScheduler, group: Group, last: dict[int, int], evicted: _Evicted
    ) -> None:
        self.scheduler, self.group, self.last, self.evicted = scheduler, group, last, evicted
        self.freed = evicted.dense
        self.factory, self.spec = scheduler.context.factory, scheduler.context.spec
        self.copies: dict[int, int] = {}  # expert of the current layer -> its PAGE_COPY
        self.hot: list[int] = []
        self.dense: dict[int, int] = {}  # layer -> PAGE_COPY of its dense part
        self.kv: dict[tuple[int, int], int] = {}  # (layer, mb) -> KV_LOAD
        self.read: dict[int, int] = {}  # layer -> DISK_LOAD of its weights (disk-homed layers)
        self.start: int | None = None  # the end of the layer before (the host's barrier)
        self.pageable = not scheduler.context.weights_pinned

    def run(self) -> PlanStream:
        routing: list[ExpertCounts] = []
        yield from self._disk_load(0)
        yield from self._next_layer(0, self.freed[-1] if self.freed else None)
        for layer in range(self.spec.layers):
            self.start = self.freed[-1] if self.freed else None
            yield from self._disk_load(layer + 1)
            posts, gates = yield from self._attention(layer, routing)
            outputs: dict[int, list[int]] = {mb.index: [] for mb in self.group}
            if self.spec.is_moe_layer(layer):
                routing = yield from self._moe(layer, gates, outputs, routing)
            elif layer + 1 < self.spec.layers:
                yield from self._next_layer(layer + 1, self.start)
            combines = []
            for mb in self.group:
                tail = layer_tail(self.factory, self.spec, layer, mb, posts[mb.index], outputs[mb.index])
                yield from tail
                self.last[mb.index] = tail[-1].id
                combines.append(tail[-1].id)
            evict = self.factory.node(Op.EVICT, Lane.GPU_COMPUTE, layer, deps=combines)
            self.freed.append(evict.id)
            if layer in self.scheduler.on_disk:
                self.evicted.disk.append(evict.id)
            yield evict

    def _disk_load(self, layer: int) -> Iterator[TaskNode]:
        """§6.1: a disk-homed layer read into host memory a layer ahead, into a buffer of two such
        layers (after the layer two reads back has left the GPU's dense buffer, its last reader)."""
        if layer not in self.scheduler.on_disk:
            return
        reads, freed = self.evicted.reads, self.evicted.disk
        room = freed[reads - 2] if reads >= 2 and len(freed) >= reads - 1 else None
        node = self.factory.node(Op.DISK_LOAD, Lane.DISK_READ, layer, deps=[room])
        self.evicted.reads += 1
        self.read[layer] = node.id
        yield node

    def _next_layer(self, layer: int, issued: int | None) -> Iterator[TaskNode]:
        """Lines 4 and 6: the layer's dense weights and its first batch's cache, issued when the host
        gets there (`issued`: the end of the layer before, where no routing request holds the host
        back). The dense buffer holds two layers:
        the copy waits for the eviction before the layer in use (during layer l, that of l - 1; at a
        group's start, before the previous group's last layer, that of the one before it)."""
        back = 2 if layer == 0 else 1
        room = self.freed[-back] if len(self.freed) >= back else None
        deps = [room, self.read.get(layer), issued]
        copy = self.factory.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, deps=deps, pageable=self.pageable)
        self.dense[layer] = copy.id
        yield copy
        yield self._kv_load(layer, self.group[0], issued)

    def _kv_load(self, layer: int, mb: MicroBatchShape, issued: int | None) -> TaskNode:
        """The cache is pageable: Klotski's CPU cache is FlexGen's, allocated unpinned."""
        node = self.factory.node(Op.KV_LOAD, Lane.GPU_H2D, layer, mb, deps=[issued], pageable=True)
        node = self._kept(node)
        self.kv[(layer, mb.index)] = node.id
        return node

    def _kept(self, node: TaskNode) -> TaskNode:
        """A cache copy of a layer whose cache the GPU keeps moves nothing."""
        return evolve(node, bytes=0) if node.layer < self.scheduler.kv_kept else node

    def _attention(
        self, layer: int, before: list[ExpertCounts]
    ) -> SubPlan[tuple[dict[int, int], dict[int, int]]]:
        """Algorithm 1's attention layer, batch by batch: the next batch's cache in, attention with
        the cache store; the hot experts prefetched behind the layer's last cache load. Then its gate
        layer, batch by batch, once the hot experts are in (line 18's sync(load_weight_stream) ends
        the attention layer). What the host issues here waits for the layer before to end (`start`).
        -> (POST_ATTN ids, GATE ids)."""
        f, posts, gates = self.factory, {}, {}
        hot = self._predict(layer, before) if self.spec.is_moe_layer(layer) else []
        for k, mb in enumerate(self.group):
            if k + 1 < len(self.group):
                yield self._kv_load(layer, self.group[k + 1], self.start)
            if k == max(0, len(self.group) - 2):  # behind the layer's last cache load
                yield from (self._copy(layer, e, self.start) for e in hot)
            kv = self.kv.pop((layer, mb.index))
            nodes = offloaded_kv_attention(f, layer, mb, self.last[mb.index], kv, self.dense[layer])
            store = self._kept(evolve(nodes.store, pageable=True))  # KV_STORE into the unpinned cache
            nodes = evolve(nodes, store=store)
            posts[mb.index] = nodes.post.id
            yield from nodes
        if self.spec.is_moe_layer(layer):
            synced = [self.copies[e] for e in hot]
            for mb in self.group:
                gate = f.node(Op.GATE, Lane.GPU_COMPUTE, layer, mb, deps=[posts[mb.index], *synced])
                gates[mb.index] = gate.id
                yield gate
        return posts, gates

    def _moe(
        self, layer: int, gates: dict[int, int], outputs: dict[int, list[int]], before: list[ExpertCounts]
    ) -> SubPlan[list[ExpertCounts]]:
        """Routing and cold copies in arrival order, the next layer's weights and first cache, then the
        FFNs hot first. -> this layer's routing."""
        routing, hot, cold = [], self.hot, []
        resident = self.scheduler.resident[layer]
        for mb in self.group:
            counts = yield from routing_of(RoutingRequest(layer, mb.index, gates[mb.index]))
            routing.append(counts)
            for e in counts.experts:
                if e not in resident and e not in self.copies:
                    cold.append(e)
                    yield self._copy(layer, e, gates[mb.index])
        used = {e for counts in routing for e in counts.experts}
        for e in hot:
            if e not in used:
                yield self.factory.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=e, deps=[self.copies[e]])
        self.scheduler.table.learn(before, routing)
        if layer + 1 < self.spec.layers:
            yield from self._next_layer(layer + 1, None)  # issued once the last gate's routing is read
        first = sorted(e for e in used if e in resident or e in hot)
        for e in first + cold:
            yield from self._ffns(layer, e, routing, gates, outputs, self.copies.get(e))
        return routing

    def _ffns(
        self,
        layer: int,
        expert: int,
        routing: list[ExpertCounts],
        gates: dict[int, int],
        outputs: dict[int, list[int]],
        copy: int | None,
    ) -> Iterator[TaskNode]:
        """The expert for every micro-batch of the group routed to it, then its eviction."""
        for mb, counts in zip(self.group, routing, strict=True):
            tokens = counts.tokens(expert)
            if tokens:
                deps = [gates[mb.index], copy]
                ffn = self.factory.node(
                    Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, expert, deps=deps, tokens=tokens
                )
                outputs[mb.index].append(ffn.id)
                yield ffn
        if copy is not None:
            yield self.factory.node(Op.EVICT, Lane.GPU_COMPUTE, layer, expert=expert, deps=[copy])

    def _predict(self, layer: int, before: list[ExpertCounts]) -> list[int]:
        """The K hot experts of `layer` predicted from `before` (the previous MoE layer's routing)."""
        among = [e for e in range(self.spec.moe.experts) if e not in self.scheduler.resident[layer]]
        self.hot = self.scheduler.table.hot(layer, before, self.scheduler.k, among)
        self.copies = {}
        return self.hot

    def _copy(self, layer: int, expert: int, after: int | None) -> TaskNode:
        deps = [after, self.read.get(layer)]
        node = self.factory.node(
            Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=expert, deps=deps, pageable=self.pageable
        )
        self.copies[expert] = node.id
        return node
