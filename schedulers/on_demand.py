"""`on-demand`: the Accelerate / DeepSpeed-style offloading baseline. Experts are fetched when used.

The dense part of every layer (attention, router, shared expert or dense MLP) is
resident; no routed expert is. Layer after layer, micro-batch after micro-batch,
the gate runs, and then each routed expert is copied in (PAGE_COPY on `gpu.h2d`)
just before its FFN runs on the GPU, and evicted right after. This is what a
forward hook that moves a module's weights to the GPU on call and back
afterwards does (Accelerate's `cpu_offload`, DeepSpeed ZeRO-Inference's
parameter fetch), and the "MoE-OnDemand" baseline of Pre-gated MoE (Hwang et
al., ISCA 2024, Sec. III): nothing is known about an expert before its gate has
chosen it, and nothing is kept after it has run.

The weight buffer holds `SLOTS` (2) experts: while the FFN of one expert runs,
the copy of the next may proceed, at most one expert ahead. A copy into a slot
waits for the EVICT of the expert that used it before. Evictions are issued on
`gpu.h2d` itself, after the FFN they free, so the copy lane (and its CUDA
stream) is ordered behind the compute that read the buffer. Buffers are not
shared between micro-batches: the next micro-batch fetches its experts again.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

from flowmoe.core.plan import Lane, Op, TaskNode
from flowmoe.core.scheduling import (
    MicroBatchShape,
    PlanStream,
    Residency,
    Scheduler,
    SchedulerContext,
    StepShape,
    SubPlan,
)
from flowmoe.schedulers.layer_nodes import check_placement, gate_and_route, model_order

SLOTS = 2  # experts the GPU buffer holds: the one computing and the next one copying


class OnDemandScheduler(Scheduler):
    name: ClassVar[str] = "on-demand"
    summary: ClassVar[str] = "dense parts resident; each routed expert copied in before its FFN, then evicted"

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        check_placement(self.name, context.policy)

    @property
    def slots(self) -> int:
        return min(SLOTS, self.context.spec.moe.experts)

    def residency(self) -> Residency:
        return Residency.dense_only(self.context.spec)

    def weight_buffer_bytes(self) -> int:
        spec = self.context.spec
        has_moe = any(spec.is_moe_layer(layer) for layer in range(spec.layers))
        return self.slots * spec.expert_bytes if has_moe else 0

    def plan(self, step: StepShape) -> PlanStream:
        return model_order(self.context.factory, self.context.spec, step, self._experts)

    def _experts(self, layer: int, mb: MicroBatchShape, post: int) -> SubPlan[list[int]]:
        """Gate, then per routed expert: copy, FFN, evict, through a ring of `slots` buffers.
        Returns the FFN node ids."""
        f = self.context.factory
        gate, counts = yield from gate_and_route(f, layer, mb, post)
        in_use: deque[TaskNode] = deque()  # FFNs whose expert still holds a slot, oldest first
        ffns: list[int] = []
        for expert, tokens in counts.counts:
            if len(in_use) == self.slots:
                yield self._evict(in_use.popleft(), mb)
            copy = f.node(Op.PAGE_COPY, Lane.GPU_H2D, layer, mb, expert, deps=[gate])
            ffn = f.node(
                Op.EXPERT_FFN, Lane.GPU_COMPUTE, layer, mb, expert, deps=[gate, copy.id], tokens=tokens
            )
            yield copy
            yield ffn
            in_use.append(ffn)
            ffns.append(ffn.id)
        while in_use:
            yield self._evict(in_use.popleft(), mb)
        return ffns

    def _evict(self, ffn: TaskNode, mb: MicroBatchShape) -> TaskNode:
        """Free the slot of `ffn`'s expert once the FFN has read it (on the copy lane: see above)."""
        return self.context.factory.node(Op.EVICT, Lane.GPU_H2D, ffn.layer, mb, ffn.expert, deps=[ffn.id])
