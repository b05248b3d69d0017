"""`fiddler`: Fiddler's CPU-GPU orchestration of experts (Kamahori et al., 2024, §3, Algorithm 1).

Initialization (§3.3, §3.4): non-expert weights and the KV cache live on the
GPU; then the most popular experts of the whole model, `weights_gpu_share` of
all of them, are placed on the GPU. Popularity is a routing profile: in
`flowmoe run`, `--routing-profile` (a trace written by `--record-routing`,
Fiddler's offline ShareGPT profile in its place); in `flowmoe simulate`, the
routing the simulation uses. Without one every expert is equally popular and
the ties go to expert 0 of every layer, then expert 1, ... (the placement is
then arbitrary, as the paper's "random selection" baseline).

Execution (§3.2-3.3, Algorithm 1): after a layer's gate, each routed expert that
is not resident either runs on the CPU, where its weights are, with the
activations moving instead (HIDDEN_OFFLOAD, EXPERT_FFN on cpu.compute,
EXPERT_LOAD), or has its weights copied to the GPU and runs there (PAGE_COPY,
EXPERT_FFN on the GPU, EVICT), whichever Algorithm 1's comparison
cpu_lat(s) > transfer_lat() + gpu_lat(s) says for its input size s. The
latencies come from the context's cost function: a hardware preset's roofline
or a `flowmoe calibrate` profile of this machine (`--hardware`); since both
are monotone in s, the comparison reduces to a token threshold found once at
start-up, as Fiddler's measured constants are. Copied experts go through a
buffer of top_k slots.

`--ffn-on cpu` takes the copy out of Algorithm 1's choice: every expert that
is not resident runs on the CPU (what Algorithm 1 picks at small batches,
where the copy rarely wins); `--ffn-on gpu` (the default) lets Algorithm 1
decide. `--attention-on cpu` is refused: Fiddler keeps attention on the GPU.

Deviations: Fiddler measures cpu_lat, gpu_lat and transfer_lat with kernels
at start-up; a scheduler here does not run kernels, so without `--hardware`
it falls back to the T4 preset's roofline and logs a warning saying so.
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.plan import ExpertCounts, Lane, Op, TaskNode
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
    Cost,
    check_placement,
    cpu_experts,
    gate_and_route,
    latency_model,
    model_order,
    moe_layers,
    popularity_ranking,
)

MAX_TOKENS = 1 << 24  # beyond this many tokens an expert is never worth copying: always the CPU


class FiddlerScheduler(Scheduler):
    name: ClassVar[str] = "fiddler"
    summary: ClassVar[str] = (
        "Fiddler: popular experts resident (a routing profile's); each other expert on the CPU or copied "
        "in, by Algorithm 1 on the latency model"
    )

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        spec = context.spec
        check_placement(self.name, context.policy, ffn=("gpu", "cpu"))
        ranked = popularity_ranking(spec, context.popularity)
        self.resident = frozenset(ranked[: round(context.policy.weights_gpu_share * len(ranked))])
        on_cpu_only = context.policy.ffn_on == "cpu"  # never copy: every other expert on the CPU
        self.threshold = None if on_cpu_only else self._calibrate(latency_model(context, self.name))
        kept = [sum(1 for layer, _ in self.resident if layer == m) for m in moe_layers(spec)]
        missing = max((spec.moe.experts - k for k in kept), default=0)
        self.slots = min(spec.moe.top_k, missing) if self.threshold is not None else 0

    def residency(self) -> Residency:
        return Residency(Residency.dense_only(self.context.spec).dense, self.resident)

    def weight_buffer_bytes(self) -> int:
        return self.slots * self.context.spec.expert_bytes

    def on_cpu(self, tokens: int) -> bool:
        """The latency model's choice for a non-resident expert given `tokens` tokens."""
        return self.threshold is None or tokens < self.threshold

    def _calibrate(self, cost: Cost) -> int | None:
        """Smallest n (tokens) with copy + GPU time <= CPU time, or None if none up to MAX_TOKENS."""

        def gpu_wins(n: int) -> bool:
            probe, mb = NodeFactory(self.context.spec), MicroBatchShape(0, n, n, n, n)
            cpu = sum(cost(node) for node in cpu_experts(probe, 0, mb, 0, [(0, n)]))
            copy = cost(probe.node(Op.PAGE_COPY, Lane.GPU_H2D, 0, expert=0))
            return copy + cost(probe.node(Op.EXPERT_FFN, Lane.GPU_COMPUTE, 0, mb, 0, tokens=n)) <= cpu

        high = 1
        while not gpu_wins(high):
            if high >= MAX_TOKENS:
                return None
            high *= 2
        low = high // 2  # gpu_wins(low) is false (or low == 0)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (low, mid) if gpu_wins(mid) else (mid, high)
        return high

    def plan(self, step: StepShape) -> PlanStream:
        f, spec = self.context.factory, self.context.spec
        evicts: list[int] = []  # EVICT of each copy so far, in order

        def routed(layer: int, mb: MicroBatchShape, post: int) -> SubPlan[list[int]]:
            gate, counts = yield from gate_and_route(f, layer, mb, post)
            return (yield from self._experts(layer, mb, gate, counts, evicts))

        return model_order(f, spec, step, routed)

    def _experts(
        self, layer: int, mb: MicroBatchShape, gate: int, counts: ExpertCounts, evicts: list[int]
    ) -> SubPlan[list[int]]:
        """The first `slots` copies (h2d), the CPU experts, then the GPU ones, each copy after the
        first `slots` issued once the eviction it reuses the slot of is. -> the outputs' last nodes."""
        f, gpu = self.context.factory, Lane.GPU_COMPUTE
        cpu = [(e, n) for e, n in counts.counts if (layer, e) not in self.resident and self.on_cpu(n)]
        on_gpu = [(e, n) for e, n in counts.counts if (e, n) not in cpu]
        copied = [e for e, _ in on_gpu if (layer, e) not in self.resident]
        base, copies = len(evicts), {}  # every earlier copy has its EVICT in `evicts`, in order

        def copy(i: int) -> TaskNode:
            reuse = base + i - self.slots
            node = f.node(
                Op.PAGE_COPY,
                Lane.GPU_H2D,
                layer,
                expert=copied[i],
                deps=[evicts[reuse]] if reuse >= 0 else [],
            )
            copies[copied[i]] = node.id
            return node

        yield from (copy(i) for i in range(min(self.slots, len(copied))))
        on_cpu = cpu_experts(f, layer, mb, gate, cpu)
        yield from on_cpu
        outputs = [on_cpu[-1].id] if on_cpu else []
        for e, n in on_gpu:
            ffn = f.node(Op.EXPERT_FFN, gpu, layer, mb, e, deps=[gate, copies.get(e)], tokens=n)
            yield ffn
            outputs.append(ffn.id)
            if e in copies:
                evict = f.node(Op.EVICT, gpu, layer, expert=e, deps=[ffn.id])
                evicts.append(evict.id)
                yield evict
                following = copied.index(e) + self.slots
                if following < len(copied):
                    yield copy(following)
        return outputs
