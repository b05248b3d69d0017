"""`flexgen`: FlexGen's zig-zag block schedule (Sheng et al., ICML 2023, §4.2 and Algorithm 1), as
MoE-Lightning runs it as a baseline (Cao et al., ASPLOS '25, §5: "FlexGen" and "FlexGen(c)").

FlexGen runs a *block* of N = μ × n sequences (n micro-batches, FlexGen's "GPU
batches", of μ sequences) column by column: layer after layer, and within a
layer over every micro-batch, so a layer's weights are loaded once per block and
reused by all its micro-batches. Algorithm 1 ("block schedule with
overlapping"), iteration (layer j, micro-batch k):

    load_weight(j + 1)         the next layer's weights (issued at k = 0)
    store_activation(j, k - 1) store_cache(j, k - 1)
    load_cache(j, k + 1)       load_activation(j, k + 1)
    compute(j, k)
    synchronize()

Here the activations between layers live on the CPU (FlexGen's `--percent
... 0 100`): each micro-batch's residual stream goes to the CPU after its layer
(ACT_STORE, d2h) and comes back before the next (ACT_LOAD, h2d). So does the KV
cache, but for `kv_gpu_share` of it (FlexGen's cache GPU percent): every cache
layer of a micro-batch of n sequences keeps its first ⌊kv_gpu_share × n⌋
sequences on the GPU, as FlexGen's mixed-device cache splits its batch
(`kv_gpu_sequences`), and only the rest crosses the link. The plan prices
that split: a copy moves (n - kept) / n of the micro-batch's cache layer, and a
real run allocates the kept sequences on the GPU and copies only the others
(so the real copy is that share of a whole-cache copy; the bytes agree exactly
where the sequences are equally long, as FlexGen pads them). All of it on the
GPU: no cache transfers at all (`kv_on_gpu`).

The I/O of iteration (j, k) is the next layer's weights (at k = 0), the
stores of (j, k - 1) and the loads of the next iteration's cache layer and
activations; `synchronize()` is a barrier: every node of iteration
(j, k), its compute and its I/O alike, finishes before anything of iteration
(j, k + 1) starts, so I/O overlaps only the compute issued with it; the
iteration's last node carries `sync`, which the cost model charges the
hardware's synchronisation latency.

Attention (`--attention-on`): `gpu` is FlexGen (MoE-Lightning's schedule S4):
the cache layer is loaded (KV_LOAD, h2d) and this step's k, v stored back
(KV_STORE, d2h); `cpu` is FlexGen(c) (schedule S3): q, k, v go to the CPU
(QKV_OFFLOAD), attention runs there next to the cache (CPU_ATTN, priced at
the seven passes over the cache FlexGen's PyTorch path makes: `_cpu_attention`),
and its output comes back (HIDDEN_LOAD) inside the iteration, unoverlapped.

Weights: the dense part of every layer is resident, and `weights_gpu_share`
of each layer's experts (the lowest-numbered ones: FlexGen's static per-layer
split, not routing-aware) stays resident too. The rest of layer j + 1's
experts, every one whether routed or not, since FlexGen knows nothing of
routing, are copied in at iteration (j, 0) into a double buffer of two layers
(FlexGen's `weight_read_buf`) and evicted after layer j + 1's last iteration.
Every routed expert's FFN runs on the GPU (`--ffn-on cpu` is refused: FlexGen
computes every layer on the GPU).

Deviations: FlexGen issues weight and cache loads on separate CUDA streams
over one link; flowmoe has one `gpu.h2d` lane, which runs them in Algorithm 1's
order (the weights, then the cache); since every iteration ends in the
barrier, the order within an iteration does not move its end. FlexGen's
wrap-around prefetch of the next step's layer 0 has no counterpart, since a
plan covers one step; layer 0's weights are copied at the step's start. In a
prefill step KV_LOAD brings an empty cache layer (no bytes cross the link).

The cache's copies are pageable (`pageable` nodes, priced at the hardware's
pageable bandwidth): FlexGen allocates its CPU cache unpinned
(flexgen/pytorch_backend.py, `init_cache_one_gpu_batch`: "disable pin_memory
due to high memory overhead"). flowmoe's runtime keeps its own cache where the
engine put it; only the simulated time follows FlexGen. So are the weight copies
where the weights are not pinned (`weights_pinned` False in the context: MoE-Lightning's
FlexGen port builds its policy with `pin_weight=False`, artifact
benchmarks/flexgen/mtbench_run_8x7b_moe.py); flowmoe's runtime pins them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from attrs import evolve

from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.scheduling import (
    MicroBatchShape,
    PlanStream,
    R,
    Residency,
    Scheduler,
    SchedulerContext,
    StepShape,
    SubPlan,
)
from flowmoe.schedulers.layer_nodes import (
    check_placement,
    copied_experts,
    embeddings,
    evict_experts,
    kept_sequences,
    kv_transfer,
    layer_tail,
    lm_heads,
    two_layers_bytes,
)

FLEXGEN_CPU_PASSES = 7  # bytes FlexGen's CPU attention moves per cached byte (see _cpu_attention)


class FlexGenScheduler(Scheduler):
    name: ClassVar[str] = "flexgen"
    summary: ClassVar[str] = (
        "FlexGen zig-zag block schedule: activations and the CPU share of the KV cache loaded a "
        "micro-batch ahead, one synchronisation per (layer, micro-batch); --attention-on cpu is FlexGen(c)"
    )

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        spec = context.spec
        check_placement(self.name, context.policy, attention=("gpu", "cpu"))
        self.cpu_attention = context.policy.attention_on == "cpu"
        self.kv_share = 0.0 if self.cpu_attention else context.policy.kv_gpu_share  # cache kept on the GPU
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
        """FlexGen with all of the cache on the GPU (--percent x y 100 0 ...); else its home is the CPU."""
        return self.kv_share == 1.0

    def kv_gpu_sequences(self, sequences: int) -> int:
        """Of a micro-batch's `sequences` cache slots, the whole sequences every cache layer keeps on
        the GPU (`kept_sequences`, FlexGen's rounding); none with CPU attention."""
        return kept_sequences(self.kv_share, sequences)

    def plan(self, step: StepShape) -> PlanStream:
        return _Block(self, step).run()


class _Block:
    """One step: the iterations (layer, micro-batch) of Algorithm 1, each ended by synchronize()."""

    def __init__(self, scheduler: FlexGenScheduler, step: StepShape) -> None:
        self.scheduler, self.step = scheduler, step
        self.factory, self.spec = scheduler.context.factory, scheduler.context.spec
        self.order = [(layer, mb) for layer in range(self.spec.layers) for mb in step.micro_batches]
        self.last: dict[int, int] = {}  # micro-batch -> its last node so far
        self.kv: dict[tuple[int, int], int] = {}  # (layer, mb) -> KV_LOAD
        self.attn: dict[tuple[int, int], int] = {}  # (layer, mb) -> GPU_ATTN (what KV_STORE waits for)
        self.stored: dict[tuple[int, int], int] = {}  # (layer, mb) -> ACT_STORE of its output
        self.loaded: dict[tuple[int, int], int] = {}  # (layer, mb) -> ACT_LOAD of its input
        self.copies: dict[int, dict[int, int]] = {}  # layer -> expert -> PAGE_COPY
        self.combines: dict[int, list[int]] = {}  # layer -> COMBINE ids
        self.lanes: dict[Lane, int] = {}  # this iteration's last node on each lane
        self.barrier: list[int] = []  # the iteration before's last node on each lane (synchronize())

    def run(self) -> PlanStream:
        f, mbs, layers = self.factory, self.step.micro_batches, self.spec.layers
        nodes, self.last = embeddings(f, self.step)
        yield from map(self._emit, nodes)
        if self._loads_cache():
            yield self._emit(self._kv_load(*self.order[0]))
        self.copies[0] = yield from self._copy(0)
        for i, (layer, mb) in enumerate(self.order):
            self.barrier, self.lanes = list(self.lanes.values()), {}
            if mb is mbs[0]:  # load_weight(j + 1), after freeing layer j - 1's buffer
                if layer >= 1:
                    done = [*self.combines[layer - 1], *self.barrier]
                    evicts = evict_experts(f, layer - 1, self.copies.pop(layer - 1), done)
                    yield from map(self._emit, evicts)
                if layer + 1 < layers:
                    self.copies[layer + 1] = yield from self._copy(layer + 1)
                self.combines[layer] = []
            if i >= 1:  # store_activation(j, k - 1), store_cache(j, k - 1)
                yield from self._stores(*self.order[i - 1])
            ahead = self.order[i + 1] if i + 1 < len(self.order) else None
            if ahead is not None and self._loads_cache():  # load_cache(j, k + 1)
                yield self._emit(self._kv_load(*ahead))
            if self._act_load_ready(layer, mb):  # load_activation(j, k), if its store was too late
                yield self._act_load(layer, mb)
            if ahead is not None and self._act_load_ready(*ahead):  # load_activation(j, k + 1)
                yield self._act_load(*ahead)
            yield from self._compute(layer, mb)
        self.barrier, self.lanes = list(self.lanes.values()), {}
        yield from self._stores(*self.order[-1])
        evicts = evict_experts(f, layers - 1, self.copies.pop(layers - 1), self.combines[layers - 1])
        yield from map(self._emit, evicts)
        yield from lm_heads(f, self.step, self.last)

    def _emit(self, node: TaskNode) -> TaskNode:
        self.lanes[node.lane] = node.id
        return node

    def _copy(self, layer: int) -> SubPlan[dict[int, int]]:
        """load_weight(layer): every offloaded expert, after the barrier. -> expert -> PAGE_COPY id."""
        copies, unpinned = {}, not self.scheduler.context.weights_pinned
        for e in self.scheduler.offloaded(layer):
            copy = self.factory.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, expert=e, deps=self.barrier,
                               pageable=unpinned)  # fmt: skip
            node = self._emit(copy)
            copies[e] = node.id
            yield node
        return copies

    def _loads_cache(self) -> bool:
        """GPU attention over a cache whose home (or part of it) is the CPU."""
        return not self.scheduler.cpu_attention and not self.scheduler.kv_on_gpu()

    def _kept(self, mb: MicroBatchShape) -> int:
        """The sequences of mb's cache layers the GPU keeps (`kv_gpu_sequences`)."""
        return self.scheduler.kv_gpu_sequences(mb.sequences)

    def _kv_load(self, layer: int, mb: MicroBatchShape) -> TaskNode:
        node = kv_transfer(self.factory, Op.KV_LOAD, layer, mb, self.barrier, self._kept(mb), pageable=True)
        self.kv[(layer, mb.index)] = node.id
        return node

    def _act_load_ready(self, layer: int, mb: MicroBatchShape) -> bool:
        """Whether the input of (layer, mb) is stored on the CPU and not loaded back yet."""
        key = (layer, mb.index)
        return layer >= 1 and key not in self.loaded and (layer - 1, mb.index) in self.stored

    def _act_load(self, layer: int, mb: MicroBatchShape) -> TaskNode:
        deps = [self.stored[(layer - 1, mb.index)], *self.barrier]
        node = self._emit(self.factory.node(Op.ACT_LOAD, Lane.GPU_H2D, layer, mb, deps=deps))
        self.loaded[(layer, mb.index)] = node.id
        return node

    def _stores(self, layer: int, mb: MicroBatchShape) -> PlanStream:
        """store_activation and store_cache of an iteration, in the one after it."""
        key = (layer, mb.index)
        if key in self.attn:
            deps = [self.attn.pop(key), *self.barrier]
            yield self._emit(
                kv_transfer(self.factory, Op.KV_STORE, layer, mb, deps, self._kept(mb), pageable=True)
            )
        if layer + 1 < self.spec.layers:  # the last layer's output stays for the LM head
            deps = [self.last[mb.index], *self.barrier]
            node = self._emit(self.factory.node(Op.ACT_STORE, Lane.GPU_D2H, layer, mb, deps=deps))
            self.stored[key] = node.id
            yield node

    def _compute(self, layer: int, mb: MicroBatchShape) -> PlanStream:
        """compute(j, k): attention (on the GPU, or FlexGen(c)'s on the CPU), the gate, the routed
        experts and the tail."""
        f, spec, gpu = self.factory, self.spec, Lane.GPU_COMPUTE
        key = (layer, mb.index)
        deps = [self.last[mb.index], self.loaded.get(key), *self.barrier]
        pre = self._emit(f.node(Op.PRE_ATTN, gpu, layer, mb, deps=deps))
        yield pre
        if self.scheduler.cpu_attention:
            qkv = self._emit(f.node(Op.QKV_OFFLOAD, Lane.GPU_D2H, layer, mb, deps=[pre.id]))
            attn = self._emit(self._cpu_attention(layer, mb, qkv.id))
            back = self._emit(f.node(Op.HIDDEN_LOAD, Lane.GPU_H2D, layer, mb, deps=[attn.id]))
            yield from (qkv, attn, back)
            post = self._emit(f.node(Op.POST_ATTN, gpu, layer, mb, deps=[back.id]))
        else:
            attn = self._emit(f.node(Op.GPU_ATTN, gpu, layer, mb, deps=[pre.id, self.kv.pop(key, None)]))
            if self._loads_cache():
                self.attn[key] = attn.id
            yield attn
            post = self._emit(f.node(Op.POST_ATTN, gpu, layer, mb, deps=[attn.id]))
        yield post
        outputs: list[int] = []
        if spec.is_moe_layer(layer):
            stream = copied_experts(f, layer, mb, post.id, self.copies[layer])
            outputs = yield from _emitted(stream, self._emit)
        tail = layer_tail(f, spec, layer, mb, post.id, outputs)
        tail[-1] = evolve(tail[-1], sync=True)  # synchronize(): the host waits for the iteration's end
        tail = [self._emit(n) for n in tail]
        yield from tail
        self.combines[layer].append(tail[-1].id)
        self.last[mb.index] = tail[-1].id

    def _cpu_attention(self, layer: int, mb: MicroBatchShape, qkv: int) -> TaskNode:
        """FlexGen(c)'s attention on the CPU, priced as FlexGen computes it
        (flexgen/pytorch_backend.py, `mha_gen`): the cached k and v are permuted and reshaped into
        new tensors (a copy, read and write at 2 bytes an element), cast with `.float()` (read 2,
        write 4) and then read by `torch.bmm` in float32 (4): 14 bytes moved per cached element
        where a fused kernel reads 2, so the node moves the cache's bytes 7 times."""
        node = self.factory.node(Op.CPU_ATTN, Lane.CPU_COMPUTE, layer, mb, deps=[qkv])
        cache = mb.kv_tokens * 2 * self.spec.attention.kv_width * self.spec.dtype_bytes
        return evolve(node, bytes=node.bytes + (FLEXGEN_CPU_PASSES - 1) * cache)


def _emitted(stream: SubPlan[R], emit: Callable[[TaskNode], TaskNode]) -> SubPlan[R]:
    """Pass a sub-plan through, recording each node it yields; returns the sub-plan's value."""
    answer = None
    try:
        while True:
            item = stream.send(answer)
            answer = yield emit(item) if isinstance(item, TaskNode) else item
    except StopIteration as done:
        return done.value
