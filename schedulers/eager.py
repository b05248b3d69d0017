"""`eager`: the reference schedule. Every weight resident on the GPU, one lane, no overlap.

Layer after layer, micro-batch after micro-batch, the steps run in model order
on `gpu.compute`, exactly as the eager model does; every other scheduler is
checked against its tokens.
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.plan import Lane, Op, RoutingRequest
from flowmoe.core.scheduling import PlanStream, Residency, SchedulerContext, StepShape


class EagerScheduler:
    name: ClassVar[str] = "eager"
    summary: ClassVar[str] = "all weights resident, model order on one GPU lane (the reference)"

    def __init__(self, context: SchedulerContext) -> None:
        self.context = context

    def residency(self) -> Residency:
        return Residency.everything(self.context.spec)

    def weight_buffer_bytes(self) -> int:
        return 0

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
        for layer in range(spec.layers):
            for mb in step.micro_batches:
                pre = f.node(Op.PRE_ATTN, gpu, layer, mb, deps=[last[mb.index]])
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
                        ffn = f.node(Op.EXPERT_FFN, gpu, layer, mb, expert, deps=[gate.id], tokens=tokens)
                        yield ffn
                        parts.append(ffn.id)
                if not spec.is_moe_layer(layer) or spec.moe.has_shared:
                    shared = f.node(Op.SHARED_FFN, gpu, layer, mb, deps=[post.id])
                    yield shared
                    parts.append(shared.id)
                combine = f.node(Op.COMBINE, gpu, layer, mb, deps=[post.id, *parts])
                yield combine
                last[mb.index] = combine.id
        for mb in step.micro_batches:
            yield f.node(Op.LM_HEAD, gpu, mb=mb, deps=[last[mb.index]])
