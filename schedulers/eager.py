"""`eager`: the reference schedule. Every weight resident on the GPU, one lane, no overlap.

Layer after layer, micro-batch after micro-batch, the steps run in model order
on `gpu.compute`, exactly as the eager model does; every other scheduler is
checked against its tokens.
"""

from __future__ import annotations

from typing import ClassVar

from flowmoe.core.scheduling import PlanStream, Residency, Scheduler, SchedulerContext, StepShape
from flowmoe.schedulers.layer_nodes import check_placement, copied_experts, model_order


class EagerScheduler(Scheduler):
    name: ClassVar[str] = "eager"
    summary: ClassVar[str] = "all weights resident, model order on one GPU lane (the reference)"

    def __init__(self, context: SchedulerContext) -> None:
        super().__init__(context)
        check_placement(self.name, context.policy)

    def residency(self) -> Residency:
        return Residency.everything(self.context.spec)

    def plan(self, step: StepShape) -> PlanStream:
        f = self.context.factory
        return model_order(
            f, self.context.spec, step, lambda layer, mb, post: copied_experts(f, layer, mb, post, {})
        )
